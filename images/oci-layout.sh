# Sourced by images/*/build.sh: write one OCI image layout from one uncompressed layer tarball.
#
#   oci_write_layout WORK LAYER_TAR CONFIG_FIELDS TAG OUT
#
# WORK is a scratch directory, LAYER_TAR the layer (already in sorted order with fixed mtimes and
# owners), CONFIG_FIELDS the inside of the image config's "config" object (JSON, e.g.
# '"Entrypoint":["/x"]'), TAG the ref name in index.json. OUT is replaced if it already holds a layout
# (or is empty); anything else there is refused. Deterministic: gzip -n, JSON written byte for byte.
# Sets OCI_MANIFEST (hex digest), OCI_LAYER (hex), OCI_LAYER_SIZE and OCI_CONFIG (hex).
# Needs: gzip, sha256sum, stat (coreutils).

oci_write_layout() {
    local work="$1" layer_tar="$2" fields="$3" tag="$4" out="$5"
    local blobs="$work/oci/blobs/sha256" diff_id config_size manifest_size
    rm -rf "$work/oci"
    mkdir -p "$blobs"
    diff_id="$(_oci_sha "$layer_tar")"
    gzip -n -9 -c "$layer_tar" >"$work/layer.tar.gz"
    OCI_LAYER="$(_oci_put "$work/layer.tar.gz" "$blobs")"
    OCI_LAYER_SIZE="$(stat -c %s "$work/layer.tar.gz")"

    printf '%s' '{"architecture":"amd64","os":"linux",'\
'"config":{'"$fields"'},'\
'"rootfs":{"type":"layers","diff_ids":["sha256:'"$diff_id"'"]}}' >"$work/config.json"
    OCI_CONFIG="$(_oci_put "$work/config.json" "$blobs")"
    config_size="$(stat -c %s "$work/config.json")"

    printf '%s' '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",'\
'"config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:'"$OCI_CONFIG"'","size":'"$config_size"'},'\
'"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:'"$OCI_LAYER"'","size":'"$OCI_LAYER_SIZE"'}]}' \
        >"$work/manifest.json"
    OCI_MANIFEST="$(_oci_put "$work/manifest.json" "$blobs")"
    manifest_size="$(stat -c %s "$work/manifest.json")"

    printf '%s' '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json",'\
'"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:'"$OCI_MANIFEST"'","size":'"$manifest_size"','\
'"annotations":{"org.opencontainers.image.ref.name":"'"$tag"'"}}]}' >"$work/oci/index.json"
    printf '%s' '{"imageLayoutVersion":"1.0.0"}' >"$work/oci/oci-layout"

    if [ -e "$out" ]; then
        if [ -f "$out/oci-layout" ] || [ -z "$(ls -A "$out")" ]; then
            rm -rf "$out"
        else
            echo "--out $out exists and is not an OCI layout; refusing to replace it" >&2
            return 1
        fi
    fi
    mkdir -p "$(dirname "$out")"
    mv "$work/oci" "$out"
}

_oci_sha() { sha256sum "$1" | cut -d' ' -f1; }
# Store a file as a blob; prints its digest (hex).
_oci_put() { local d; d="$(_oci_sha "$1")"; cp "$1" "$2/$d"; echo "$d"; }
