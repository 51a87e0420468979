#!/usr/bin/env bash
# Standalone mode on this machine, by hand (root, Linux with cgroup v2).
#
#   examples/standalone/try.sh             build, write build 1's manifest, run
#                                          standalone mode in the foreground
#   examples/standalone/try.sh release N [overlap|hold]
#                                          (another terminal) make build N and
#                                          rewrite the manifest to release it
#   examples/standalone/try.sh status      print the status file
#   examples/standalone/try.sh ask         one request through current.sock
#   examples/standalone/try.sh logs [ARGS] the instance's output (node-agent logs)
#
# Everything lives in $GENSWAP_EXAMPLE_DIR (default /tmp/genswap-standalone);
# Ctrl-C stops standalone mode, which stops the instance (--stop-on-exit).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
work=${GENSWAP_EXAMPLE_DIR:-/tmp/genswap-standalone}
instances=$work/instances
staging=$work/staging
manifest=$instances/hello.yaml
socket=$work/run/default.hello/current.sock

target_dir() {
  cargo metadata --manifest-path "$repo/Cargo.toml" --format-version 1 --no-deps \
    | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p'
}

# make_build N: a copy of the test app with N appended, so each build has its
# own bytes and digest (an ELF file ignores trailing bytes).
make_build() {
  local n=$1 source
  source="$(target_dir)/debug/genswap-testapp"
  [ -x "$source" ] || cargo build -q --manifest-path "$repo/Cargo.toml" -p testapp --bin genswap-testapp
  { cat "$source"; printf 'hello-%s' "$n"; } > "$staging/.hello-$n.tmp"
  chmod 0755 "$staging/.hello-$n.tmp"
  mv "$staging/.hello-$n.tmp" "$staging/hello-$n"
}

# write_manifest N MODE: the manifest for build N, written to a hidden temp
# file and renamed into place, so standalone mode never reads half a file.
write_manifest() {
  local n=$1 mode=$2 sha
  sha=$(sha256sum "$staging/hello-$n" | cut -d' ' -f1)
  sed -e "s|@BUILD_ID@|hello-$n|" -e "s|@ARTIFACT@|$staging/hello-$n|" \
      -e "s|@SHA256@|$sha|" -e "s|@MODE@|$mode|" \
      "$here/hello.yaml.in" > "$instances/.hello.yaml.tmp"
  mv "$instances/.hello.yaml.tmp" "$manifest"
}

case "${1:-run}" in
  run)
    cargo build -q --manifest-path "$repo/Cargo.toml" -p node-agent -p testapp --bins
    mkdir -p "$instances" "$staging"
    # Instances run as nobody: they must reach the run dir and the store.
    chmod 0755 "$work"
    make_build 1
    write_manifest 1 overlap
    cat <<HINT
Standalone mode over $instances (Ctrl-C stops it and the instance).
In another terminal:
  $0 status               # $instances/status/hello.yaml
  $0 ask                  # curl --unix-socket $socket http://hello/
  $0 logs --follow        # its output, from $work/logs/default_hello/
  $0 release 2            # overlap release to build hello-2
  $0 release 3 hold       # hold release to build hello-3
HINT
    exec "$(target_dir)/debug/node-agent" standalone \
      --dir "$instances" \
      --state-dir "$work/state" \
      --run-dir "$work/run" \
      --staging-root "$staging" \
      --log-dir "$work/logs" \
      --stop-on-exit
    ;;
  release)
    make_build "${2:?release needs a build number}"
    write_manifest "$2" "${3:-overlap}"
    echo "wrote $manifest (hello-$2, ${3:-overlap}); watch $instances/status/hello.yaml"
    ;;
  status)
    cat "$instances/status/hello.yaml"
    ;;
  ask)
    curl -sS --unix-socket "$socket" http://hello/
    ;;
  logs)
    shift
    exec "$(target_dir)/debug/node-agent" logs default/hello --log-dir "$work/logs" "$@"
    ;;
  *)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
