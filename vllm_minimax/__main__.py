from vllm_minimax.entry import run

raise SystemExit(run())
