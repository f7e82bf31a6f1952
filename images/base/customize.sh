#!/bin/sh
# mmdebstrap --customize-hook of images/base/build.sh: $1 is the new root. Adds the runner user
# (uid/gid 1001, passwordless sudo), the docker group membership, dockerd's configuration and
# imp-start-dockerd (dockerd started as root before the runner, readiness awaited, log kept).
set -eu
root="$1"

chroot "$root" groupadd --gid 1001 runner
chroot "$root" useradd --uid 1001 --gid 1001 --create-home --home-dir /home/runner \
    --shell /bin/bash --groups docker runner
printf 'runner ALL=(ALL:ALL) NOPASSWD: ALL\n' >"$root/etc/sudoers.d/runner"
chmod 0440 "$root/etc/sudoers.d/runner"
# sudo's lecture file and the home's skeleton are fine; nothing else of the user is dated.

# dockerd's socket group is the runner's own group: the guest starts the runner with its primary
# group only (no supplementary groups), so membership of `docker` would not reach it. The runner
# has passwordless sudo anyway: the socket gives it nothing more.
mkdir -p "$root/etc/docker"
cat >"$root/etc/docker/daemon.json" <<'JSON'
{
  "group": "runner",
  "storage-driver": "overlay2",
  "log-driver": "json-file",
  "log-opts": {"max-size": "10m", "max-file": "2"}
}
JSON

mkdir -p "$root/usr/local/sbin" "$root/usr/local/bin"
cat >"$root/usr/local/sbin/imp-start-dockerd" <<'SH'
#!/bin/sh
# Start dockerd (root) in the background and wait until it answers, before the runner starts
# (imp-runner runs this with sudo when it exists). The log is kept in /var/log/imp/dockerd.log
# (in the VM; the console gets the summary line). Exit 0 once ready, 1 when it did not come up
# within IMP_DOCKERD_WAIT_S (default 180 s: TCG is slow): the runner starts either way.
set -u
# dockerd runs iptables, modprobe and friends from sbin; the caller's PATH may lack it.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
wait_s="${IMP_DOCKERD_WAIT_S:-180}"
log=/var/log/imp/dockerd.log
mkdir -p /var/log/imp
if [ -S /var/run/docker.sock ] && docker version >/dev/null 2>&1; then
    echo "imp-start-dockerd: dockerd already running"
    exit 0
fi
start=$(date +%s)
setsid dockerd >>"$log" 2>&1 </dev/null &
pid=$!
while :; do
    if docker version >/dev/null 2>&1; then
        echo "imp-start-dockerd: dockerd ready after $(($(date +%s) - start)) s (pid $pid, log $log)"
        exit 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "imp-start-dockerd: dockerd exited; last lines of $log:" >&2
        tail -n 20 "$log" >&2
        exit 1
    fi
    if [ $(($(date +%s) - start)) -ge "$wait_s" ]; then
        echo "imp-start-dockerd: dockerd not ready after $wait_s s; last lines of $log:" >&2
        tail -n 20 "$log" >&2
        exit 1
    fi
    sleep 0.5
done
SH
chmod 0755 "$root/usr/local/sbin/imp-start-dockerd"

# The image's OCI entrypoint (for running it outside Imp, e.g. a plain container): dockerd first,
# then the command. Imp's guest does not use it: imp-runner calls imp-start-dockerd.
cat >"$root/usr/local/bin/imp-base-entrypoint" <<'SH'
#!/bin/sh
set -eu
if [ "$(id -u)" = 0 ]; then /usr/local/sbin/imp-start-dockerd || true
else sudo -n /usr/local/sbin/imp-start-dockerd || true; fi
[ $# -gt 0 ] || set -- /bin/bash
exec "$@"
SH
chmod 0755 "$root/usr/local/bin/imp-base-entrypoint"
