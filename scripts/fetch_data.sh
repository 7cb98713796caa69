#!/usr/bin/env bash
# Fetch the offline long texts that evals/data.py reads.
#
# The texts ship inside Debian packages of R data sets, so apt (which works where only
# package registries are reachable) is the only download channel needed; R is not:
#   r-cran-janeaustenr  Jane Austen's six novels (~4.0M characters, ~1.6 MB .deb)
#   r-cran-tokenizers   Moby Dick (~1.2M characters, ~0.7 MB .deb); skip with KVP_FETCH_MOBYDICK=0
# Each package's R directory (DESCRIPTION, data/Rdata.{rdx,rdb}, ...) and its Debian copyright
# file land in $KVP_DATA/<debian package>/ (default: <repo>/data/, git-ignored).
#
# Idempotent: a package already extracted is skipped. Offline: a matching .deb placed in
# $KVP_DATA (e.g. r-cran-janeaustenr_1.0.0-1_all.deb) is used instead of downloading.
# Non-interactive (never reads stdin); `apt-get update` runs only when the package lists lack
# a package.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${KVP_DATA:-$repo/data}"
export DEBIAN_FRONTEND=noninteractive

note() { echo "fetch_data.sh: $*" >&2; }
die() { echo "fetch_data.sh: error: $*" >&2; exit 1; }

mkdir -p "$dest" || die "cannot create '$dest' (set KVP_DATA to a writable folder)"
dest="$(cd "$dest" && pwd)"
work="$(mktemp -d "$dest/.fetch.XXXXXX")"
trap 'rm -rf "$work"' EXIT

as_root() {  # run a command as root, or say how to get the package lists without it
  if [[ $EUID -eq 0 ]]; then "$@"
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo -n "$@"
  else die "'$*' needs root; run it once yourself, then rerun this script"
  fi
}

download() {  # $1 Debian package -> prints the path of its .deb
  local pkg=$1 local_deb
  local_deb="$(compgen -G "$dest/${pkg}_*.deb" | sort | tail -n 1 || true)"
  if [[ -n $local_deb ]]; then
    note "using $local_deb"
    echo "$local_deb"
    return
  fi
  command -v apt-get >/dev/null || die "apt-get not found, so $pkg cannot be downloaded. On a \
non-Debian system, download ${pkg}_*.deb from https://packages.debian.org/stable/$pkg, put it \
in '$dest' and rerun this script (extracting it needs dpkg-deb, or ar and tar)."
  # As root, apt drops to the _apt user, which cannot write into our private work folder.
  local opts=()
  [[ $EUID -eq 0 ]] && opts=(-o APT::Sandbox::User=root)
  local log="$work/apt-$pkg.log"
  if ! (cd "$work" && apt-get "${opts[@]}" -q download "$pkg") </dev/null >"$log" 2>&1; then
    if grep -qE "Unable to locate package|has no installation candidate|Can't select" "$log"; then
      note "the apt package lists do not know $pkg yet: running apt-get update"
      as_root apt-get -q update </dev/null >"$work/apt-update.log" 2>&1 \
        || { cat "$work/apt-update.log" >&2; die "apt-get update failed"; }
      (cd "$work" && apt-get "${opts[@]}" -q download "$pkg") </dev/null >"$log" 2>&1 \
        || { cat "$log" >&2; die "apt-get download $pkg failed after apt-get update"; }
    else
      cat "$log" >&2
      die "apt-get download $pkg failed (is a Debian mirror reachable?)"
    fi
  fi
  compgen -G "$work/${pkg}_*.deb" | head -n 1
}

extract() {  # $1 .deb, $2 folder to unpack it into
  if command -v dpkg-deb >/dev/null; then
    dpkg-deb -x "$1" "$2"
  elif command -v ar >/dev/null; then
    local member
    member="$(ar t "$1" | grep '^data\.tar' | head -n 1)" || die "$1 has no data.tar member"
    (cd "$2" && ar x "$1" "$member" && tar -xf "$member" && rm -f "$member")
  else
    die "neither dpkg-deb nor ar is installed, so $1 cannot be unpacked"
  fi
}

fetch() {  # $1 Debian package, $2 R package name inside it
  local pkg=$1 rpkg=$2 out="$dest/$1"
  if [[ -s $out/data/Rdata.rdx && -s $out/data/Rdata.rdb ]]; then
    note "$pkg already present in $out (delete it to fetch again)"
    return
  fi
  local deb root="$work/root-$pkg"
  deb="$(download "$pkg")"
  [[ -n $deb && -f $deb ]] || die "apt-get download $pkg produced no .deb"
  mkdir -p "$root" || die "cannot create $root"
  extract "$deb" "$root" || die "could not unpack $deb"
  local rdir="$root/usr/lib/R/site-library/$rpkg"
  [[ -s $rdir/data/Rdata.rdx && -s $rdir/data/Rdata.rdb ]] \
    || die "$deb does not hold usr/lib/R/site-library/$rpkg/data/Rdata.{rdx,rdb}"
  cp "$root/usr/share/doc/$pkg/copyright" "$rdir/debian-copyright" 2>/dev/null || true
  basename "$deb" >"$rdir/debian-package"
  rm -rf "$out"
  # Same file system (work is inside dest), so the new folder appears at once, whole.
  mv "$rdir" "$out" || die "could not move $rdir to $out"
  note "extracted $(basename "$deb") into $out"
}

fetch r-cran-janeaustenr janeaustenr
if [[ ${KVP_FETCH_MOBYDICK:-1} != 0 ]]; then
  # Optional: a failure here leaves Austen usable, so it warns instead of failing the set-up.
  (fetch r-cran-tokenizers tokenizers) \
    || note "warning: r-cran-tokenizers not fetched, so the 'mobydick' text is unavailable"
fi
note "done: texts in $dest"
