# Sourced by docker/build.sh and docker/test.sh: picks the container engine and the flags this machine needs.
#   ENGINE      docker when its daemon answers, else podman (installed with apt-get when run as root)
#   BUILD_FLAGS podman: the host's CA bundle mounted into every build step (pip's TLS behind a proxy's CA)
#   RUN_FLAGS   podman: limits the machine allows (set by probe_run_flags, once an image exists)
# podman runs with runc and cgroupfs where runc is installed: crun refuses some machines' cgroups.

PODMAN_PKGS="podman runc mmdebstrap"

apt_install() {
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "error: $1 is missing; install it (apt-get install $1)" >&2
    return 1
  fi
  echo "installing $1"
  # shellcheck disable=SC2086  # a list of package names
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $1 >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $1 >/dev/null; }
}

pick_engine() {
  BUILD_FLAGS=()
  RUN_FLAGS=()
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    ENGINE=(docker)
    return
  fi
  command -v podman >/dev/null || apt_install "$PODMAN_PKGS" ||
    { echo "error: neither docker (with a running daemon) nor podman is usable" >&2; return 1; }
  ENGINE=(podman)
  if command -v runc >/dev/null; then
    ENGINE+=(--runtime runc --cgroup-manager=cgroupfs)
  fi
  if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    BUILD_FLAGS+=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
  fi
}

has_image() {
  "${ENGINE[@]}" image inspect "$1" >/dev/null 2>&1
}

# The Debian base: BASE when the engine has it or can pull it, else one made from Debian's own packages with
# mmdebstrap (no registry needed) and imported as localhost/debian-base:SUITE. Prints the image to build FROM.
resolve_base() {
  local base=$1 suite name
  for name in "$base" "docker.io/library/$base"; do  # podman may not resolve a short name
    if has_image "$name" || "${ENGINE[@]}" pull -q "$name" >/dev/null 2>&1; then
      echo "$name"
      return
    fi
  done
  suite=$(sed -E 's/.*:([a-z]+).*/\1/' <<<"$base")
  if has_image "localhost/debian-base:$suite"; then
    echo "localhost/debian-base:$suite"
    return
  fi
  echo "$base cannot be pulled: making localhost/debian-base:$suite from Debian's packages (mmdebstrap)" >&2
  command -v mmdebstrap >/dev/null || apt_install mmdebstrap >&2
  local tar
  tar=$(mktemp --suffix=.tar)
  mmdebstrap --quiet --variant=minbase --include=ca-certificates "$suite" "$tar" >&2
  "${ENGINE[@]}" import "$tar" "localhost/debian-base:$suite" >/dev/null
  rm -f "$tar"
  echo "localhost/debian-base:$suite"
}

# Where a plain `run` fails on the engine's default limits (its open-files and process limits can exceed what this
# machine lets a process set), the host's own: open files, and processes up to kernel.pid_max.
probe_run_flags() {
  local image=$1 nofile nproc
  "${ENGINE[@]}" run --rm --entrypoint true "$image" >/dev/null 2>&1 && return
  nofile=$(ulimit -Hn)
  nproc=$(ulimit -Hu)
  if [ "$nproc" = unlimited ] || [ "$nproc" -gt "$(cat /proc/sys/kernel/pid_max)" ]; then
    nproc=$(cat /proc/sys/kernel/pid_max)
  fi
  RUN_FLAGS=(--ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc")
  "${ENGINE[@]}" run --rm "${RUN_FLAGS[@]}" --entrypoint true "$image" >/dev/null || {
    echo "error: $image does not run here with ${ENGINE[*]} ${RUN_FLAGS[*]}" >&2
    return 1
  }
}
