"""`python -m sglang.launch_server --model-path ...`: start the HTTP server."""

import logging
import sys

from sglang.srt.entrypoints.http_server import launch_server
from sglang.srt.server_args import prepare_server_args


def main(argv: list[str]) -> None:
    server_args = prepare_server_args(argv)
    logging.basicConfig(level=server_args.log_level.upper(), format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    try:
        launch_server(server_args)
    except (ValueError, RuntimeError, OSError) as e:  # launch checks, startup failures: no traceback
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
