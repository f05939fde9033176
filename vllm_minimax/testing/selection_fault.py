"""A planted builder bug for the end-to-end control run (`engine_run.py --fault page-count`).

`install_page_count_fault()` makes the patched vLLM's FlashInfer builder hand every
call each token's page count less one (at least one page): the token's own block is
never selected, and the trailing window falls on the block before. A run with it is
the control each engine comparison of tests/gpu_e2e/test_engine.py must fail.
"""

from __future__ import annotations

from collections.abc import Callable


def install_page_count_fault() -> Callable[[], None]:
    """Install the fault class-wide; returns a function that removes it."""
    from vllm.models.minimax_m3.nvidia.indexer_flashinfer import (
        MiniMaxM3IndexerFlashInferMetadataBuilder as Builder,
    )

    build = Builder.build

    def faulty_build(self, *args, **kwargs):
        metadata = build(self, *args, **kwargs)
        for call in metadata.calls:
            call.num_valid_pages.sub_(1).clamp_(min=1)
        return metadata

    def restore() -> None:
        Builder.build = build

    Builder.build = faulty_build
    return restore
