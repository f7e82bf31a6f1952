#!/usr/bin/env python3
"""Push a tiny linux/amd64 OCI image (one gzip layer with the given files) to a plain-HTTP registry.

    push-image.py 127.0.0.1:5000 imp/runner-base:smoke etc/imp-smoke=hello ...
Used by smoke/imp-smoke.sh --local to give imp-runtime's rootfs cache something real to pull."""
import gzip, hashlib, io, json, sys, tarfile, time, urllib.request

host, repo_tag, *files = sys.argv[1:]
repo, tag = repo_tag.rsplit(":", 1)

def sha(b): return "sha256:" + hashlib.sha256(b).hexdigest()

raw = io.BytesIO()
with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as t:
    dirs = set()
    for spec in files:
        path, content = spec.split("=", 1)
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d not in dirs:
                dirs.add(d); ti = tarfile.TarInfo(d); ti.type = tarfile.DIRTYPE; ti.mode = 0o755; ti.mtime = 0; t.addfile(ti)
        data = content.encode(); ti = tarfile.TarInfo(path); ti.size = len(data); ti.mode = 0o644; ti.mtime = 0
        t.addfile(ti, io.BytesIO(data))
tar = raw.getvalue()
layer = gzip.compress(tar, mtime=0)
config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                     "rootfs": {"type": "layers", "diff_ids": [sha(tar)]}}).encode()

def req(method, url, body=None, headers=None):
    r = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    return urllib.request.urlopen(r, timeout=30)

def push_blob(b):
    loc = req("POST", f"http://{host}/v2/{repo}/blobs/uploads/").headers["Location"]
    if loc.startswith("/"): loc = f"http://{host}{loc}"
    sep = "&" if "?" in loc else "?"
    req("PUT", f"{loc}{sep}digest={sha(b)}", b, {"Content-Type": "application/octet-stream"})

for _ in range(40):
    try: req("GET", f"http://{host}/v2/"); break
    except Exception: time.sleep(0.25)
push_blob(layer); push_blob(config)
manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
    "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha(config), "size": len(config)},
    "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": sha(layer), "size": len(layer)}]}).encode()
req("PUT", f"http://{host}/v2/{repo}/manifests/{tag}", manifest, {"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
print(f"{host}/{repo}:{tag}")
