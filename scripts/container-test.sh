#!/usr/bin/env bash
# Build the service's container images with podman, start them for real and test them
# (tests/test_container.py): what `make test-container` and CI run.
#
#   bash scripts/container-test.sh          # set up, build, test (prints each phase's time)
#   bash scripts/container-test.sh build    # set up and build only
#   eval "$(bash scripts/container-test.sh env)"   # then use podman / podman-compose by hand
#
# No Docker engine runs here and no image registry can be reached, so the script sets up
# what it needs (idempotent: it installs what is missing, it never skips):
#   - podman, runc, debootstrap from Debian's apt; podman-compose 1.6.0 from PyPI in a venv
#     of its own (Debian's 1.0.3 cannot read the compose file's `env_file: {path, required}`
#     and ignores `profiles`);
#   - a containers.conf of its own: the runc runtime (crun refuses this kernel's hybrid
#     cgroups) and lower rlimits (nofile 10000, nproc 4096);
#   - a base image made from Debian packages: debootstrap --variant=minbase bookworm with
#     python3, python3-venv and ca-certificates, imported once (podman keeps it);
#   - the tls profile's proxy image (docker/Dockerfile.tls: nginx-light) on that base;
#   - pip inside the builds uses this host's pip setup: its CA bundle, its find-links folders
#     and local file:// indexes are mounted read-only (the CPU torch wheel lies there). The
#     Dockerfiles themselves stay as users run them: PyTorch's wheel index by default.
# Images are built in two passes: the builder stage with those mounts, then the whole image
# without them (the builder comes from the layer cache), so the final image holds none of
# them. podman keeps its layers between runs: a second run rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
STATE=${WORLDCUP_CONTAINER_STATE:-/var/tmp/worldcup-container}
BASE_IMAGE=localhost/worldcup-base:bookworm
CPU_IMAGE=localhost/worldcup:cpu-ci
CUDA_BUILDER_IMAGE=localhost/worldcup:cuda-builder-ci
REDIS_IMAGE=localhost/worldcup-redis:ci
TLS_IMAGE=localhost/worldcup-tls:ci
COMPOSE_VERSION=1.6.0
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
T0=$(date +%s)

phase() { echo "container-test: [$(($(date +%s) - T0)) s] $*" >&2; }

conf() {
  mkdir -p "$STATE"
  cat > "$STATE/containers.conf" <<'EOF'
# written by scripts/container-test.sh
[containers]
default_ulimits = ["nofile=10000:10000", "nproc=4096:4096"]

[engine]
runtime = "runc"
EOF
  export CONTAINERS_CONF=$STATE/containers.conf
}

tools() {
  local missing=()
  command -v podman > /dev/null || missing+=(podman)
  command -v runc > /dev/null || missing+=(runc)
  command -v debootstrap > /dev/null || missing+=(debootstrap)
  [ -x /usr/lib/podman/aardvark-dns ] || missing+=(aardvark-dns)
  # netavark sets up the build's and the stack's networks with iptables (a machine without
  # it fails every RUN step that needs the network: "netavark: No such file or directory")
  command -v iptables > /dev/null || missing+=(iptables)
  python3 -c "import ensurepip, venv" 2> /dev/null || missing+=(python3-venv)
  if [ "${#missing[@]}" -gt 0 ]; then
    phase "apt-get install ${missing[*]}"
    local sudo=""
    if [ "$(id -u)" -ne 0 ] && command -v sudo > /dev/null; then sudo=sudo; fi
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      podman runc debootstrap netavark aardvark-dns iptables python3-venv
  fi
  if ! "$STATE/venv/bin/podman-compose" version 2> /dev/null | grep -q "$COMPOSE_VERSION"; then
    phase "podman-compose $COMPOSE_VERSION into $STATE/venv"
    rm -rf "$STATE/venv"
    python3 -m venv "$STATE/venv"
    "$STATE/venv/bin/python" -m pip install --quiet "podman-compose==$COMPOSE_VERSION"
  fi
}

# The build's pip configuration and read-only mounts, from this host's own pip setup.
pip_mounts() {
  python3 - "$STATE/pip.conf" <<'EOF'
import os, re, subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                     text=True, check=False).stdout
values = {}
for line in out.splitlines():
    m = re.match(r"^[^.]*\.([a-z-]+)='(.*)'$", line)
    if m:
        values.setdefault(m.group(1), []).extend(m.group(2).split())
cert = os.environ.get("PIP_CERT") or next(iter(values.get("cert", [])), "")
links = list(dict.fromkeys(p for p in values.get("find-links", []) if os.path.isdir(p)))
indexes = list(dict.fromkeys(u for u in values.get("extra-index-url", [])
                             if u.startswith("file://") and os.path.isdir(u[len("file://"):])))
lines = ["[global]"]
mounts = []
if cert and os.path.isfile(cert):
    lines.append(f"cert = {cert}")
    mounts.append(cert)
if links:
    lines.append("find-links = " + " ".join(links))
    mounts += links
if indexes:
    lines.append("extra-index-url = " + " ".join(indexes))
    # a local index's pages link to files beside it (<root>/simple -> <root>/files)
    mounts += [os.path.dirname(u[len("file://"):].rstrip("/")) for u in indexes]
with open(sys.argv[1], "w") as f:
    f.write("\n".join(lines) + "\n")
for path in dict.fromkeys(mounts):
    print(f"-v {path}:{path}:ro")
print(f"-v {sys.argv[1]}:/etc/pip.conf:ro")
EOF
}

base() {
  if podman image exists "$BASE_IMAGE"; then
    return
  fi
  phase "debootstrap bookworm (minbase) for $BASE_IMAGE"
  local dir
  dir=$(mktemp -d /var/tmp/worldcup-rootfs.XXXXXX)
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$dir" "$MIRROR" > "$STATE/debootstrap.log" 2>&1 \
    || { tail -20 "$STATE/debootstrap.log" >&2; rm -rf "$dir"; exit 1; }
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
  tar -C "$dir" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" > /dev/null
  rm -rf "$dir"
}

# build IMAGE DOCKERFILE [podman build args...]: the builder stage with the host's pip setup
# mounted, then the whole image without it (the builder stage comes from the cache).
build() {
  local image=$1 dockerfile=$2
  shift 2
  local mounts
  read -r -a mounts <<< "$(pip_mounts | tr '\n' ' ')"
  phase "build $image ($dockerfile): builder stage"
  podman build --format docker --target builder -t "$image-builder" "${mounts[@]}" \
    --build-arg PYTHON_IMAGE="$BASE_IMAGE" --build-arg TORCH_INDEX=https://pypi.org/simple \
    "$@" -f "$dockerfile" "$ROOT" > "$STATE/build-$(basename "$dockerfile").log" 2>&1 \
    || { tail -40 "$STATE/build-$(basename "$dockerfile").log" >&2; exit 1; }
  if [ "${TARGET_BUILDER_ONLY:-0}" = 1 ]; then
    podman tag "$image-builder" "$image"
    return
  fi
  phase "build $image ($dockerfile): the image"
  # the mounts again: the builder stage is cached from above unless the tree changed
  # in between, and a rebuild of it needs the host's pip setup too
  podman build --format docker -t "$image" "${mounts[@]}" \
    --build-arg PYTHON_IMAGE="$BASE_IMAGE" --build-arg TORCH_INDEX=https://pypi.org/simple \
    "$@" -f "$dockerfile" "$ROOT" >> "$STATE/build-$(basename "$dockerfile").log" 2>&1 \
    || { tail -40 "$STATE/build-$(basename "$dockerfile").log" >&2; exit 1; }
}

redis_image() {
  cat > "$STATE/Containerfile.redis" <<EOF
# written by scripts/container-test.sh: Redis from Debian's package (no image registry
# here), run as the official image runs it: protected mode off (that image's build turns
# it off; the compose network is the boundary and Redis's port is not published)
FROM $BASE_IMAGE
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \\
    && rm -rf /var/lib/apt/lists/* \\
    && printf '#!/bin/sh\\nif [ "\$1" = redis-server ]; then shift; set -- redis-server --protected-mode no "\$@"; fi\\nexec "\$@"\\n' > /usr/local/bin/entrypoint \\
    && chmod 755 /usr/local/bin/entrypoint
WORKDIR /data
ENTRYPOINT ["/usr/local/bin/entrypoint"]
CMD ["redis-server"]
EOF
  phase "build $REDIS_IMAGE"
  podman build --format docker -t "$REDIS_IMAGE" -f "$STATE/Containerfile.redis" "$STATE" \
    > "$STATE/build-redis.log" 2>&1 || { tail -20 "$STATE/build-redis.log" >&2; exit 1; }
}

# The compose profile tls's proxy: docker/Dockerfile.tls (Debian's nginx-light) on the same
# Debian base; its certificate is made by the test (scripts/tls-cert.sh), never built in.
tls_image() {
  phase "build $TLS_IMAGE (docker/Dockerfile.tls)"
  podman build --format docker -t "$TLS_IMAGE" --build-arg BASE_IMAGE="$BASE_IMAGE" \
    -f docker/Dockerfile.tls "$ROOT" > "$STATE/build-tls.log" 2>&1 \
    || { tail -20 "$STATE/build-tls.log" >&2; exit 1; }
}

images() {
  base
  build "$CPU_IMAGE" docker/Dockerfile
  # The CUDA image: no GPU and no nvidia base image here. Its Dockerfile is built on the
  # Debian base up to the stage that installs the project (ENGINE=hf: vLLM's CUDA wheels are
  # not installed), and the test checks that this package set runs the CLI.
  TARGET_BUILDER_ONLY=1 build "$CUDA_BUILDER_IMAGE" docker/Dockerfile.cuda \
    --build-arg CUDA_IMAGE="$BASE_IMAGE" --build-arg ENGINE=hf
  redis_image
  tls_image
  podman image prune -f > /dev/null  # the images the rebuilds replaced (no cache is lost)
  phase "images: $(podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' \
    | grep -E 'worldcup(-redis|-base|-tls)?:' | tr '\n' ';')"
}

export_env() {
  export WORLDCUP_CT_CPU_IMAGE=$CPU_IMAGE WORLDCUP_CT_CUDA_BUILDER_IMAGE=$CUDA_BUILDER_IMAGE
  export WORLDCUP_CT_REDIS_IMAGE=$REDIS_IMAGE WORLDCUP_CT_TLS_IMAGE=$TLS_IMAGE
  export WORLDCUP_CT_STATE=$STATE
  export WORLDCUP_CT_COMPOSE=$STATE/venv/bin/podman-compose
}

case "${1:-all}" in
  env)
    conf
    echo "export CONTAINERS_CONF=$STATE/containers.conf"
    echo "alias podman-compose=$STATE/venv/bin/podman-compose"
    ;;
  build)
    conf
    tools
    images
    ;;
  all)
    conf
    tools
    images
    export_env
    phase "tests/test_container.py tests/test_container_compose.py"
    bash scripts/pytest.sh tests/test_container.py tests/test_container_compose.py \
      -m container -p no:cacheprovider -rP
    phase "done"
    ;;
  *)
    echo "usage: $0 [all|build|env]" >&2
    exit 2
    ;;
esac
