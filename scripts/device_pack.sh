#!/usr/bin/env bash
# Here, before training on a lent GPU (the device tool sends at most 64 MiB a call: the tracked tree is already more,
# and the embedded target alone is a 98 MB GGUF), so scripts/gpu_train.sh can run there:
#   scripts/device_pack.sh pack     .device/ (ignored), in two loads under 64 MiB: one/ (the wheels the device image
#                                   lacks, the first half of the target) and two/ (the second half, its checksum, and
#                                   the corpus with every prompt's ids stored: the device lacks the packages the mined
#                                   prompts are rebuilt from, so the copy holds their text; never commit it)
#   scripts/device_pack.sh slim     untrack docs/, data/ and the shipped drafts (index only, files kept), so the tree
#                                   that travels is ~1 MiB; refuses while anything is staged
#   scripts/device_pack.sh unslim   undo slim (back to HEAD's index)
# Then three device calls, back to back (the machine stays warm 30 s, and /tmp with it; a call's tree lacks what the
# call before carried, so --setup keeps each load in /tmp/dflash-site):
#   run(command="scripts/gpu_train.sh --setup", carry=[".device/one"])
#   run(command="scripts/gpu_train.sh --setup", carry=[".device/two"])
#   run(command="CORPUS=/tmp/dflash-site/corpus ONLINE=1 SEQS=64 MINUTES=2.5 PACK_TO=$OUT scripts/gpu_train.sh
#       /tmp/train dspark dflash2", carry=["src/dflash_hf/drafts/smollm2-135m-dspark",
#       "src/dflash_hf/drafts/smollm2-135m-dflash2"], timeout_s=600)
# The trained drafts come back as drafts.tar.part-* beside train.log (cat the parts | tar -x).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
SLIM=(docs data src/dflash_hf/drafts)

case "${1:-}" in
  pack)  # the wheels: what the GGUF target needs beyond the device image's own packages
    grep -qxF '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
    rm -rf .device && mkdir -p .device/one .device/two
    PYTHON="$PYTHON" scripts/device_wheels.sh .device/one/wheels transformers kernels gguf
    gguf=$("$PYTHON" -c 'from dflash_hf.defaults import SMOLLM2_GGUF, smollm2_dir; print(smollm2_dir() / SMOLLM2_GGUF)')
    # Halves of 47 MiB: one rides with the 15 MiB of wheels, the other with the ~10 MiB corpus.
    split -n 2 -d "$gguf" .device/target.part-
    mv .device/target.part-00 .device/one/ && mv .device/target.part-01 .device/two/
    (cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > .device/two/target.sha256
    "$PYTHON" -m dflash_hf.cli corpus --out data/smollm2-135m --export .device/two/corpus
    du -sh .device/one .device/two
    ;;
  slim)
    git diff --cached --quiet || { echo "device_pack: something is staged; commit or unstage it first" >&2; exit 1; }
    git rm -r -q --cached "${SLIM[@]}"
    for path in "${SLIM[@]}"; do grep -qxF "/$path/" .git/info/exclude || echo "/$path/" >> .git/info/exclude; done
    echo "untracked for the device: ${SLIM[*]} ($(git ls-files | xargs du -cb | tail -1 | cut -f1) bytes travel)"
    ;;
  unslim)
    git reset -q
    for path in "${SLIM[@]}"; do sed -i "\#^/$path/\$#d" .git/info/exclude; done
    git status --short | head
    ;;
  *) echo "usage: scripts/device_pack.sh pack|slim|unslim" >&2; exit 2 ;;
esac
