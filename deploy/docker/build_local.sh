#!/usr/bin/env bash
# Build the pdserve image on a machine without Docker or registry access: buildah, chroot isolation,
# from a Debian base made locally with debootstrap (cached). Run from anywhere, as root:
#
#   bash deploy/docker/build_local.sh [cpu|cuda]    build, tag, print "tag: TAG" and "size: N GB"
#   bash deploy/docker/build_local.sh --print-tag [cpu|cuda]    print the tag only (no build)
#
# cpu (default): torch's CPU wheel, no GPU extra; the image the cpu-demo overlay runs.
# cuda: the default CUDA base (nvidia/cuda runtime; pulled, so it needs registry access) unless
#   PDSERVE_BASE_IMAGE names another one, torch's CUDA wheels, the gpu extra.
#
# Environment:
#   PDSERVE_IMAGE_CACHE  where the debootstrap base tarball is kept (default ~/.cache/pdserve/images)
#   PDSERVE_BASE_IMAGE   base image for the chosen variant (cpu default: the local Debian base)
#   PDSERVE_DEBIAN_MIRROR  debootstrap mirror (default http://deb.debian.org/debian)
#   PDSERVE_IMAGE_TAG    override the printed tag
#   PDSERVE_TORCH_VERSION, PDSERVE_TORCH_INDEX_URL  the CPU variant's torch (default 2.13.0+cpu from
#                        pip's find-links when they hold it, else https://download.pytorch.org/whl/cpu)
#   BUILDAH_ISOLATION    default chroot (containers cannot nest here)
# The host's pip configuration (index, find-links) and CA bundle are mounted read-only into the RUN
# steps so pip resolves like it does on the host (a TLS-inspecting proxy, a local wheel directory);
# nothing of it is copied into the image. The cuda variant leaves find-links out (they may hold the
# CPU torch wheel, which pip would prefer to the CUDA one of the same version).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"

print_only=0
if [ "${1:-}" = --print-tag ]; then print_only=1; shift; fi
variant="${1:-cpu}"
case "$variant" in cpu|cuda) ;; *) echo "usage: build_local.sh [--print-tag] [cpu|cuda]" >&2; exit 2 ;; esac

version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml" | head -1)"
[ -n "$version" ] || { echo "build_local.sh: no version in pyproject.toml" >&2; exit 1; }
if [ "$variant" = cpu ]; then default_tag="pdserve:$version-cpu"; else default_tag="pdserve:$version"; fi
TAG="${PDSERVE_IMAGE_TAG:-$default_tag}"
if [ "$print_only" = 1 ]; then echo "$TAG"; exit 0; fi

for tool in buildah debootstrap; do
    command -v "$tool" >/dev/null || { echo "build_local.sh: $tool is missing (apt-get install $tool)" >&2; exit 1; }
done
export BUILDAH_ISOLATION="${BUILDAH_ISOLATION:-chroot}"
CACHE="${PDSERVE_IMAGE_CACHE:-$HOME/.cache/pdserve/images}"
DEBIAN_BASE=localhost/debian:bookworm-minbase
TORCH_VERSION="${PDSERVE_TORCH_VERSION:-2.13.0}"  # as in the Dockerfile's TORCH_SPEC and scripts/dev.sh
log() { echo "build_local.sh: $*" >&2; }

# ---- the local Debian base: debootstrap once into a cached tarball, imported once into storage ----
make_base() {
    buildah inspect --type image "$DEBIAN_BASE" >/dev/null 2>&1 && return 0
    local tarball="$CACHE/debian-bookworm-minbase.tar"
    if [ ! -s "$tarball" ]; then
        mkdir -p "$CACHE"
        ROOTFS="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
        log "debootstrap --variant=minbase bookworm (about a minute)"
        debootstrap --variant=minbase bookworm "$ROOTFS" "${PDSERVE_DEBIAN_MIRROR:-http://deb.debian.org/debian}" \
            >"$CACHE/debootstrap.log" 2>&1 || { log "debootstrap failed, see $CACHE/debootstrap.log"; exit 1; }
        rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
        tar --numeric-owner -C "$ROOTFS" -cf "$tarball.tmp" .
        mv "$tarball.tmp" "$tarball"
        remove_rootfs
    fi
    log "importing $tarball as $DEBIAN_BASE"
    local ctr
    ctr="$(buildah from scratch)"
    buildah add --quiet "$ctr" "$tarball" / >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
    buildah commit --quiet --rm "$ctr" "$DEBIAN_BASE" >/dev/null
}

pip_find_links() {
    command -v python3 >/dev/null && python3 -m pip config get global.find-links 2>/dev/null || true
}

# ---- the host's pip set-up, offered read-only to the RUN steps ----
# Prints buildah arguments: -v mounts for the CA bundle, a generated pip.conf (the host's settings
# named by $2) and the local directories that it names, plus --build-arg PIP_CONFIG_FILE / PIP_CERT pointing at them.
pip_mounts() {
    local work="$1" keys="$2" py cert key value dir
    py="$(command -v python3 || true)"
    [ -n "$py" ] || return 0
    local conf="$work/pip.conf"
    echo "[global]" >"$conf"
    for key in $keys; do
        value="$("$py" -m pip config get "global.$key" 2>/dev/null || true)"
        [ -n "$value" ] || continue
        echo "$key = $value" >>"$conf"
        for dir in $value; do
            dir="${dir#file://}"
            dir="${dir%/}"
            [ "${dir##*/}" != simple ] || dir="${dir%/simple}"  # a PEP 503 tree links to ../../files
            case "$dir" in /*) [ -d "$dir" ] && printf -- '-v\n%s:%s:ro\n' "$dir" "$dir" ;; esac
        done
    done
    printf -- '-v\n%s:/run/pdserve-build/pip.conf:ro\n--build-arg\nPIP_CONFIG_FILE=/run/pdserve-build/pip.conf\n' "$conf"
    cert="${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}"
    if [ -s "$cert" ]; then
        printf -- '-v\n%s:/run/pdserve-build/ca.crt:ro\n--build-arg\nPIP_CERT=/run/pdserve-build/ca.crt\n' "$cert"
    fi
}

# An interrupted buildah (SIGTERM, SIGPIPE) leaves its working containers: remove those this run made.
BEFORE="$(buildah containers --quiet --notruncate 2>/dev/null | sort || true)"
WORK="$(mktemp -d)"
ROOTFS=""
remove_rootfs() {  # debootstrap's target, after unmounting what an interrupted debootstrap left there
    [ -n "$ROOTFS" ] && [ -d "$ROOTFS" ] || return 0
    awk -v d="$ROOTFS/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r | xargs -r umount -l
    rm -rf "$ROOTFS" "$CACHE"/*.tar.tmp
    ROOTFS=""
}
cleanup() {
    local rc=$?
    rm -rf "$WORK"
    remove_rootfs
    if [ "$rc" != 0 ]; then
        comm -13 <(echo "$BEFORE") <(buildah containers --quiet --notruncate 2>/dev/null | sort) \
            | xargs -r buildah rm >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT
trap 'exit 143' TERM INT HUP PIPE

main() {
    local base args=()
    if [ "$variant" = cpu ]; then
        make_base
        base="${PDSERVE_BASE_IMAGE:-$DEBIAN_BASE}"
        args+=(--build-arg PDSERVE_EXTRAS= --build-arg "TORCH_SPEC=torch==$TORCH_VERSION+cpu"
               --build-arg "RUNTIME_PACKAGES=gcc libc6-dev" --build-arg PIP_UNINSTALL=triton)
        # pytorch.org's CPU index, unless pip's find-links already hold the wheel (then pip never
        # waits on an index this machine may not reach)
        local links
        links="$(pip_find_links)"
        if [ -z "$links" ] || ! ls $links 2>/dev/null | grep -q "^torch-$TORCH_VERSION+cpu-"; then
            args+=(--build-arg "TORCH_INDEX_URL=${PDSERVE_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}")
        fi
    else
        base="${PDSERVE_BASE_IMAGE:-}"
        [ "$base" != "$DEBIAN_BASE" ] || make_base
    fi
    [ -z "$base" ] || args+=(--build-arg "BASE_IMAGE=$base")
    # find-links may hold torch's CPU wheel, which pip prefers to the CUDA one of the same version
    local keys="index-url extra-index-url"
    [ "$variant" = cuda ] || keys="$keys find-links"
    mapfile -t mounts < <(pip_mounts "$WORK" "$keys")
    log "building $TAG from ${base:-the default base}"
    local t0=$SECONDS
    buildah bud --layers --force-rm --network host --isolation "$BUILDAH_ISOLATION" "${mounts[@]}" "${args[@]}" \
        -f "$ROOT/deploy/docker/Dockerfile" -t "$TAG" "$ROOT" >&2
    log "built in $((SECONDS - t0)) s"
    echo "tag: $TAG"
    echo "size: $(buildah images --format '{{.Size}}' "$TAG" | head -1)"
}
main
