"""Our modules at the full config load the released checkpoints' exact names and shapes, strictly.

State dicts are built from `shared/reference/checkpoints/*.tsv` with meta tensors (no memory) and loaded
into modules built on the meta device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reference import REFERENCE_DIR

from engines.build.verify import BLANKEN_TSV, CHECKPOINTS, CheckpointSpec, meta_module
from engines.checkpoints import load_strict, read_manifest_tsv
from engines.config import ModelConfigs
from engines.llm.hf_export import HF_BACKBONE_PREFIX
from engines.llm.model import LLM_BACKBONE_PREFIX

HF_CONVERTED_TSV = "cosyvoice2-0.5b.llm.hf-converted.DERIVED.tsv"

pytestmark = pytest.mark.skipif(
    not REFERENCE_DIR.is_dir(), reason=f"reference checkpoint manifests not found at {REFERENCE_DIR}"
)


def _meta_state(tsv: Path) -> dict[str, torch.Tensor]:
    return {name: torch.empty(shape, device="meta") for name, shape in read_manifest_tsv(tsv)}


@pytest.mark.parametrize("spec", CHECKPOINTS, ids=[spec.name for spec in CHECKPOINTS])
def test_released_checkpoint_loads_strictly(spec: CheckpointSpec) -> None:
    module = meta_module(spec, ModelConfigs.full())
    state = spec.canonical(_meta_state(REFERENCE_DIR / spec.reference_tsv))
    load_strict(module, state, spec.reference_tsv)
    assert len(state) == len(module.state_dict())


def test_blanken_weights_are_the_llm_backbone() -> None:
    llm = next(spec for spec in CHECKPOINTS if spec.name == "llm")
    backbone = meta_module(llm, ModelConfigs.full()).get_submodule(LLM_BACKBONE_PREFIX.rstrip("."))
    state = {name.removeprefix(HF_BACKBONE_PREFIX): tensor
             for name, tensor in _meta_state(REFERENCE_DIR / BLANKEN_TSV).items()}
    load_strict(backbone, state, BLANKEN_TSV)


# Manifests of files our modules do not load; each is checked by its owner.
OWNED_ELSEWHERE = {
    HF_CONVERTED_TSV: "the HF-converted LLM is engines.llm.hf_export's output and is checked by its tests",
}


@pytest.mark.parametrize(
    "tsv", sorted(path.name for path in REFERENCE_DIR.glob("*.tsv")) if REFERENCE_DIR.is_dir() else []
)
def test_every_reference_manifest_is_checked(tsv: str) -> None:
    if tsv in OWNED_ELSEWHERE:
        pytest.skip(OWNED_ELSEWHERE[tsv])
    assert tsv in {spec.reference_tsv for spec in CHECKPOINTS} | {BLANKEN_TSV}
