# Only modules the interpreter has already loaded come before the handler: `signal`
# imports enum, long enough for a Ctrl-C to land inside it.
import os
import sys

_INTERRUPTED = "vllm-minimax: interrupted\n"


def _interrupted_while_importing(signum: int, frame: object) -> None:
    """Ctrl-C before the command began: nothing to keep, so one line and exit 130.

    Raising KeyboardInterrupt here could surface as another error from inside an
    extension module's initialisation (seen: a TypeError from ``_ssl``), so this
    handler exits instead.
    """
    os.write(2, _INTERRUPTED.encode())
    os._exit(130)


try:
    import _signal

    _signal.signal(_signal.SIGINT, _interrupted_while_importing)
except KeyboardInterrupt:
    sys.stderr.write(_INTERRUPTED)
    raise SystemExit(130) from None
from vllm_minimax.entry import run  # noqa: E402

_signal.signal(_signal.SIGINT, _signal.default_int_handler)
raise SystemExit(run())
