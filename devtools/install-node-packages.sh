#!/usr/bin/env bash
# What a real node of the local cluster needs from the distribution (runc, CNI plugins, a
# static busybox for the test images, mmdebstrap for the product images' base; containerd is
# built from Go modules like the control plane), installed when missing. Only as root with
# apt-get; elsewhere it says what is missing, and the real-node tests skip with the reason.
set -u
missing=()
command -v runc >/dev/null || missing+=(runc)
[ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
command -v busybox >/dev/null || missing+=(busybox-static)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "note: a local node needs ${missing[*]} (install them as root); its tests will skip" >&2
  exit 0
fi
echo "installing ${missing[*]} for the local node" >&2
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } >/dev/null; then
  echo "note: could not install ${missing[*]}; the real-node tests will skip" >&2
fi
exit 0
