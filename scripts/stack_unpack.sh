#!/usr/bin/env bash
# Assemble a stack packed by scripts/pack_newest_stack.sh as its parts arrive over device calls,
# and unpack it into SITE once every part is there and the archive's checksum matches.
# Usage (device, checkout root): bash scripts/stack_unpack.sh DIR SITE STAGE_DIR
#   DIR: the carried folder (MANIFEST and this call's part_* files); STAGE_DIR keeps the parts
#   of earlier calls on this machine. MANIFEST lists the parts in order ("part NAME"), the
#   archive's "sha256" and the "wheel"s in it. Exit 0 when SITE holds the stack (now or
#   before), 3 while parts are missing (it names them), 1 on a checksum mismatch or a failed
#   unpack.
set -u
dir=${1:?usage: stack_unpack.sh DIR SITE STAGE_DIR} site=${2:?SITE} stage=${3:?STAGE_DIR}
mkdir -p "$stage" "$site"
[ -f "$dir/MANIFEST" ] && cp "$dir/MANIFEST" "$stage/"
if [ ! -f "$stage/MANIFEST" ]; then
  echo "stack: no MANIFEST in $dir or from an earlier call" >&2
  exit 1
fi
sha=$(sed -n 's/^sha256 //p' "$stage/MANIFEST")
if [ -f "$site/.stack-$sha" ]; then
  echo "stack: already unpacked in $site"
  exit 0
fi
for p in "$dir"/part_*; do [ -f "$p" ] && cp "$p" "$stage/"; done
mapfile -t parts < <(sed -n 's/^part //p' "$stage/MANIFEST")
if [ "${#parts[@]}" -eq 0 ]; then
  echo "stack: the MANIFEST lists no parts: pack again" >&2
  exit 1
fi
missing=()
for p in "${parts[@]}"; do [ -f "$stage/$p" ] || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "stack: $((${#parts[@]} - ${#missing[@]})) of ${#parts[@]} parts here; carry" \
    "${missing[*]} in the next call while the machine is warm"
  exit 3
fi
got=$(cd "$stage" && cat "${parts[@]}" | sha256sum | cut -d' ' -f1)
if [ "$got" != "$sha" ]; then
  echo "stack: checksum mismatch (MANIFEST $sha, parts $got): pack again" >&2
  exit 1
fi
# what the stack brings replaces what the site holds under the same names: a package folder
# of another release (FlashInfer 0.6.7's from .whl) must not keep its files among the new ones,
# nor its dist-info answer importlib.metadata
if ! (cd "$stage" && cat "${parts[@]}") | xz -d >"$stage/stack.tar"; then
  echo "stack: xz failed" >&2
  exit 1
fi
for top in $(tar -tf "$stage/stack.tar" | sed -e 's|^\./||' -e 's|/.*||' | sort -u); do
  [ -n "$top" ] || continue
  rm -rf "${site:?}/$top"
  case $top in *.dist-info) rm -rf "$site/${top%%-*}"-*.dist-info ;; esac
done
tar -xf "$stage/stack.tar" -C "$site" || { echo "stack: unpack failed" >&2; exit 1; }
rm -f "$stage/stack.tar"
touch "$site/.stack-$sha"
echo "stack: unpacked into $site:"
sed -n 's/^wheel /  /p' "$stage/MANIFEST"
