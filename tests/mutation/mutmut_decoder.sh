#!/usr/bin/env bash
# The client's pure-Python batch decoder (clients/python/shardd/_decode.py) under mutmut, with
# tests/python/test_decode.py alone (docs/testing.md, "Mutation testing"). Run on demand from
# the repository's root, after scripts/test.sh has made .venv and `cargo build` the compiled
# decoder:
#
#     bash tests/mutation/mutmut_decoder.sh
#
# mutmut 2 edits the file it mutates in place, so it runs in a worktree of HEAD under
# $TMPDIR, never in this tree. Its runner must exit 1 to count a mutant killed (any other
# failing status counts as survived): a mutant that breaks the module's import fails pytest
# with 2, so the runner maps every failure to 1.
set -euo pipefail

root=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$work/tree" 2>/dev/null || true; rm -rf "$work"' EXIT

python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q mutmut==2.5.1
git -C "$root" worktree add -q --detach "$work/tree" HEAD
ln -s "$root/target" "$work/tree/target"   # conftest finds the compiled decoder there

cd "$work/tree"
export PYTHONPATH="$work/tree/clients/python"
runner="bash -c '$root/.venv/bin/python -m pytest -x -q -p no:cacheprovider tests/python/test_decode.py || exit 1'"
"$work/venv/bin/mutmut" run --paths-to-mutate clients/python/shardd/_decode.py \
  --tests-dir tests/python --runner "$runner" --no-progress || true
"$work/venv/bin/mutmut" results
for id in $("$work/venv/bin/mutmut" result-ids survived); do
  "$work/venv/bin/mutmut" show "$id"
done
