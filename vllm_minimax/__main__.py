import sys

try:
    from vllm_minimax.entry import run
except KeyboardInterrupt:
    print("vllm-minimax: interrupted", file=sys.stderr)
    raise SystemExit(130) from None
raise SystemExit(run())
