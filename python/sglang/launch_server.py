"""`python -m sglang.launch_server --model-path ...`: start the HTTP server.

The first log line (what is being loaded) comes before anything heavy is imported: torch and
the server modules take seconds to import on a small machine.
"""

import logging
import sys

from sglang.srt.server_args import build_parser, server_args_from_namespace

logger = logging.getLogger("sglang.launch_server")


def main(argv: list[str]) -> None:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    logger.info("Loading %s; the server answers at http://%s:%d once it has loaded", ns.model_path, ns.host, ns.port)
    server_args = server_args_from_namespace(parser, ns)
    from sglang.srt.entrypoints.http_server import launch_server

    try:
        launch_server(server_args)
    except (ValueError, RuntimeError, OSError) as e:  # launch checks, startup failures: no traceback
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
