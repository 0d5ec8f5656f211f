# Sourced by scripts/test and .ci/run: the many-host tests (tests/chaos/hosts, tests/hosts.py)
# run workers as hosts in network namespaces they make themselves, inside a user namespace of
# their own, so they need no root; they are never skipped. They need iproute2 (ip, tc),
# util-linux (unshare, nsenter, setpriv), hostname, the kernel's TUN device, and permission
# to create a user namespace. As root (CI, containers) a missing package is installed with
# apt-get; anyone else is told what to install. (Their skewed clocks come from the PyPI
# package libfaketime, in the test extra.)
hosts_missing=()
for tool in ip:iproute2 tc:iproute2 unshare:util-linux nsenter:util-linux setpriv:util-linux hostname:hostname; do
    # tests/hosts.py looks in the sbin folders too: Debian keeps tc in /sbin, off a user's PATH
    PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin" command -v "${tool%%:*}" >/dev/null 2>&1 ||
        hosts_missing+=("${tool#*:}")
done
if [ "${#hosts_missing[@]}" -gt 0 ]; then
    mapfile -t hosts_missing < <(printf '%s\n' "${hosts_missing[@]}" | sort -u)
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "== installing ${hosts_missing[*]} (apt-get) for the many-host tests"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${hosts_missing[@]}" >/dev/null
    else
        echo "error: the many-host tests (tests/chaos/hosts) need the Debian packages: ${hosts_missing[*]}." >&2
        echo "Install them with 'sudo apt-get install ${hosts_missing[*]}'. These tests are never skipped." >&2
        exit 1
    fi
fi
if [ ! -e /dev/net/tun ]; then
    echo "error: the many-host tests need the kernel's TUN device (/dev/net/tun): their slow links" >&2
    echo "are TUN devices (tests/delay_line.py). Load it with 'sudo modprobe tun'." >&2
    exit 1
fi
if ! hosts_probe=$(unshare --user --map-root-user --net --mount true 2>&1); then
    echo "error: the many-host tests make their network namespaces inside a user namespace, and this" >&2
    echo "user may not create one ('unshare --user --map-root-user --net --mount true' said: $hosts_probe)." >&2
    echo "Allow unprivileged user namespaces (e.g. 'sudo sysctl kernel.apparmor_restrict_unprivileged_userns=0'" >&2
    echo "on Ubuntu 24.04, 'sudo sysctl kernel.unprivileged_userns_clone=1' on older Debian), or run as root." >&2
    exit 1
fi
unset hosts_missing hosts_probe tool
