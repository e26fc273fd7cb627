"""A stand-in rank for the worker zygote's tests (``python -m training.zygote_rank``): it does
what its arguments say, without torch, so the tests exercise the zygote's and the client's
plumbing in milliseconds."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", help="write pid, ppid, cwd, argv and ZYGOTE_TEST_VALUE here")
    parser.add_argument("--say", default="", help="print this to stdout")
    parser.add_argument("--exit", type=int, default=0)
    parser.add_argument("--signal", type=int, default=0, help="kill itself with this signal")
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.report:
        with open(args.report, "w") as f:
            value = os.environ.get("ZYGOTE_TEST_VALUE", "")
            f.write(f"{os.getpid()} {os.getppid()} {os.getcwd()} {value} {' '.join(argv)}\n")
    if args.say:
        print(args.say)
    if args.sleep:
        signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(43)))
        time.sleep(args.sleep)
    if args.signal:
        os.kill(os.getpid(), args.signal)
    return args.exit


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
