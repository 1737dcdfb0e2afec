#!/usr/bin/env bash
# Set up the tinker-cookbook acceptance environment: its own venv plus offline Hugging Face caches.
#
#   bash scripts/cookbook/setup_cookbook.sh
#
# Idempotent: re-running it skips what is already in place (a venv with the right versions, cache
# entries whose inputs did not change). Nothing here edits cookbook code, and nothing goes into .venv.
#
# What it makes (both paths must be git-ignored):
#   $COOKBOOK_VENV  (default <repo>/.venv-cookbook)  python3.11 venv: tinker-cookbook 0.6.1, tinker 0.38.0,
#                                                     torch 2.13.0 CPU, the cookbook's math-rl extra
#   $COOKBOOK_CACHE (default <repo>/.cache-cookbook) hf/ = HF_HOME for the loops: hub cache with SmolLM2's
#                                                     tokenizer (+ weights) under $COOKBOOK_MODEL_NAME, and
#                                                     datasets caches for openai/gsm8k and stand-ins for
#                                                     no_robots, hh-rlhf and DeepMath-103K (from GSM8K)
#
# Environment knobs (all optional):
#   COOKBOOK_VENV, COOKBOOK_CACHE  the two paths above
#   COOKBOOK_VERSION               tinker-cookbook version (default 0.6.1)
#   COOKBOOK_MODEL_NAME            the model name the loops get (default Qwen/Qwen3-4B-Instruct-2507, see
#                                  run_cookbook.sh for why); COOKBOOK_EXTRA_REPO_IDS adds more aliases
#   SMOLLM2_DIR                    the SmolLM2-135M-Instruct Hugging Face folder (default: asked of the
#                                  project's own loader in .venv, which converts the packaged GGUF once)
#   GSM8K_DIR                      folder with GSM8K train.jsonl/test.jsonl (default: shared/datasets/gsm8k
#                                  inside or beside the repo)
#   COOKBOOK_NO_WEIGHTS=1          leave the weights out of the hub cache (tokenizer only)
#   PYTHON311                      the python3.11 to build the venv with (default: python3.11)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

COOKBOOK_VENV="${COOKBOOK_VENV:-$repo/.venv-cookbook}"
COOKBOOK_CACHE="${COOKBOOK_CACHE:-$repo/.cache-cookbook}"
COOKBOOK_VERSION="${COOKBOOK_VERSION:-0.6.1}"
COOKBOOK_MODEL_NAME="${COOKBOOK_MODEL_NAME:-Qwen/Qwen3-4B-Instruct-2507}"
PYTHON311="${PYTHON311:-python3.11}"
CONSTRAINTS="$here/constraints.txt"

log() { printf '[setup_cookbook] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

py="$COOKBOOK_VENV/bin/python"
# pip -q still warns about every package missing from the extra local index; drop those lines.
pip_install() {
    "$py" -m pip install --disable-pip-version-check -q -c "$CONSTRAINTS" "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

# ---------------------------------------------------------------------------------------------
# 1. The venv
# ---------------------------------------------------------------------------------------------
if [[ ! -x "$py" ]]; then
    command -v "$PYTHON311" >/dev/null || die "$PYTHON311 not found (set PYTHON311)"
    log "creating $COOKBOOK_VENV with $("$PYTHON311" --version)"
    "$PYTHON311" -m venv "$COOKBOOK_VENV"
fi

# Installed version of a distribution in the venv, or empty.
have() { "$py" -c 'import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$1"; }

want_torch="$(sed -n 's/^torch==//p' "$CONSTRAINTS")"
want_tinker="$(sed -n 's/^tinker==//p' "$CONSTRAINTS")"

venv_ok() {
    [[ "$(have tinker-cookbook)" == "$COOKBOOK_VERSION" ]] &&
        [[ "$(have tinker)" == "$want_tinker" ]] &&
        [[ "$(have torch)" == "$want_torch"* ]] &&
        [[ -n "$(have math-verify)" ]] &&
        "$py" -c 'import tinker_cookbook.recipes.rl_loop, tinker_cookbook.recipes.sl_loop' 2>/dev/null
}

if venv_ok; then
    log "venv up to date: tinker-cookbook $(have tinker-cookbook), tinker $(have tinker), torch $(have torch)"
else
    # torch first, alone: the pin makes pip take the local CPU wheel; every later install is
    # constrained to it so nothing drags in a CUDA build. No torchvision/torchaudio/torchcodec.
    log "installing torch==$want_torch (CPU wheel)"
    pip_install "torch==$want_torch"
    [[ "$(have torch)" == *"+cpu" ]] || log "WARNING: torch $(have torch) is not a +cpu build"

    # tinker-cookbook 0.6.1 declares tml-renderers>=0.4.1, which the package index does not have
    # (newest there: 0.2.1). The cookbook imports tml_renderers lazily, only for Inkling/Kimi-K3
    # models (tokenizer_utils.ensure_tml_renderers_importable), so install the cookbook itself with
    # --no-deps and then every other requirement it declares, plus its math-rl extra (rl_loop needs
    # math_grading: sympy, pylatexenc, math-verify).
    log "installing tinker-cookbook==$COOKBOOK_VERSION (--no-deps) and its requirements"
    pip_install --no-deps "tinker-cookbook==$COOKBOOK_VERSION"
    mapfile -t reqs < <("$py" -c '
import importlib.metadata as m, re
for r in m.requires("tinker-cookbook") or []:
    name = re.split(r"[\s;<>=!~\[]", r, maxsplit=1)[0].lower()
    spec, _, marker = r.partition(";")
    marker = marker.strip()
    if not marker:
        if name != "tml-renderers":
            print(spec.strip())
    elif re.search(r"""extra\s*==\s*["\x27]math-rl["\x27]""", marker):
        print(spec.strip())
')
    ((${#reqs[@]})) || die "could not read tinker-cookbook's requirements"
    pip_install "${reqs[@]}"
    # If a tml-renderers new enough ever appears on the index, take it (optional: only Inkling uses it).
    pip_install "tml-renderers>=0.4.1" 2>/dev/null ||
        log "note: tml-renderers>=0.4.1 is not available here; not needed for the SmolLM2 runs"
    venv_ok || die "venv check failed after install (tinker-cookbook $(have tinker-cookbook), tinker $(have tinker), torch $(have torch))"
    log "venv ready: tinker-cookbook $(have tinker-cookbook), tinker $(have tinker), torch $(have torch)"
fi

# ---------------------------------------------------------------------------------------------
# 2. The model folder (SmolLM2-135M-Instruct as a Hugging Face folder)
# ---------------------------------------------------------------------------------------------
if [[ -z "${SMOLLM2_DIR:-}" ]]; then
    if [[ -x "$repo/.venv/bin/python" ]]; then
        # The project's own loader: converts the packaged GGUF once into ~/.cache/skyrl_trainer.
        SMOLLM2_DIR="$(cd "$repo" && "$repo/.venv/bin/python" -c '
from skyrl_trainer.backend.model_loading import resolve_model_dir
print(resolve_model_dir("SmolLM2-135M-Instruct"))' 2>/dev/null | tail -n 1)" || SMOLLM2_DIR=""
    fi
    if [[ -z "$SMOLLM2_DIR" || ! -f "$SMOLLM2_DIR/config.json" ]]; then
        SMOLLM2_DIR="${SKYRL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/skyrl_trainer}/models/SmolLM2-135M-Instruct"
    fi
fi
[[ -f "$SMOLLM2_DIR/config.json" && -f "$SMOLLM2_DIR/tokenizer.json" ]] ||
    die "no SmolLM2 Hugging Face folder at '$SMOLLM2_DIR' (set SMOLLM2_DIR, or set up .venv first)"
log "SmolLM2 folder: $SMOLLM2_DIR"

# ---------------------------------------------------------------------------------------------
# 3. GSM8K source
# ---------------------------------------------------------------------------------------------
if [[ -z "${GSM8K_DIR:-}" ]]; then
    for cand in "$repo/shared/datasets/gsm8k" "$repo/../shared/datasets/gsm8k" /work/shared/datasets/gsm8k; do
        if [[ -f "$cand/train.jsonl" ]]; then GSM8K_DIR="$(cd "$cand" && pwd)"; break; fi
    done
fi
[[ -n "${GSM8K_DIR:-}" && -f "$GSM8K_DIR/train.jsonl" && -f "$GSM8K_DIR/test.jsonl" ]] ||
    die "no GSM8K train.jsonl/test.jsonl found (set GSM8K_DIR)"
log "GSM8K source: $GSM8K_DIR"

# ---------------------------------------------------------------------------------------------
# 4. Offline caches under $COOKBOOK_CACHE/hf (= HF_HOME for the loops)
# ---------------------------------------------------------------------------------------------
repo_args=(--repo-id "$COOKBOOK_MODEL_NAME")
for r in ${COOKBOOK_EXTRA_REPO_IDS:-}; do repo_args+=(--repo-id "$r"); done
weights_args=()
[[ "${COOKBOOK_NO_WEIGHTS:-0}" == 1 ]] && weights_args=(--no-weights)

mkdir -p "$COOKBOOK_CACHE/hf"
HF_HOME="$COOKBOOK_CACHE/hf" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 \
    "$py" "$here/prepare_offline_cache.py" \
    --hf-home "$COOKBOOK_CACHE/hf" --model-dir "$SMOLLM2_DIR" --gsm8k-dir "$GSM8K_DIR" \
    "${repo_args[@]}" "${weights_args[@]}"

# ---------------------------------------------------------------------------------------------
# 5. Self-check: the loops' tokenizer/renderer/dataset calls work offline (proxy to a dead port so
#    any network attempt fails loudly instead of hanging)
# ---------------------------------------------------------------------------------------------
HF_HOME="$COOKBOOK_CACHE/hf" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 \
    "$py" "$here/check_offline.py" "$COOKBOOK_MODEL_NAME" 2> >(grep -v -e "cached version of the dataset" -e "Found the latest cached" >&2) ||
    die "offline self-check failed"

log "done. Run: bash scripts/cookbook/run_cookbook.sh <server base URL> [log dir]"
