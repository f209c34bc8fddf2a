# Sourced by scripts/pack_mamba_ssm_*.sh: read files of a state-spaces/mamba checkout, install
# the packed folder.
#   open_upstream NAME SRC REV PROBE_DIR PATHSPEC...
# SRC is a work tree (PROBE_DIR in it, REV HEAD: the files as they are on disk; PATHSPEC with
# local changes marks the commit "(+ local changes)") or a git directory (bare, a mirror, or a
# work tree read at REV). Sets `mode` (worktree | git) and `commit`, and defines `show PATH`
# (the file's text on stdout). NAME goes into the error for an SRC that is neither.
open_upstream() {
  local name=$1 src=$2 rev=$3 probe=$4; shift 4
  if [ -d "$src/$probe" ] && [ "$rev" = HEAD ]; then
    mode=worktree
    upstream_src=$src
    show() { cat "$upstream_src/$1"; }
    commit=$(git -C "$src" rev-parse HEAD 2>/dev/null || echo unknown)
    if [ "$commit" != unknown ] && [ -n "$(git -C "$src" status --porcelain -- "$@" 2>/dev/null)" ]; then
      commit="$commit (+ local changes)"
    fi
  elif git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
    mode=git
    upstream_src=$src
    commit=$(git -C "$src" rev-parse --verify "$rev^{commit}")
    show() { git -C "$upstream_src" show "$commit:$1"; }
  else
    echo "$name: $src is neither a state-spaces/mamba work tree nor a git dir" >&2
    exit 2
  fi
}

# install_pack TMP OUT COUNT: replace OUT with the packed folder TMP (made by mktemp -d, whose
# EXIT trap this clears) and say what it holds.
install_pack() {
  local tmp=$1 out=$2 count=$3
  rm -rf "$out"
  mkdir -p "$(dirname "$out")"
  mv "$tmp" "$out"
  trap - EXIT
  chmod 755 "$out"
  echo "$out: $count files + LICENSE from state-spaces/mamba $commit ($(du -sh "$out" | cut -f1))"
}
