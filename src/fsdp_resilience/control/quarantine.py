"""List quarantined nodes and return them to service, from a shell.

    .venv-airflow/bin/python -m fsdp_resilience.control.quarantine list
    ... -m fsdp_resilience.control.quarantine return slot-2 --reason "fan replaced, burn-in passed"
    ... -m fsdp_resilience.control.quarantine return-expired --cooldown-s 86400
    ... -m fsdp_resilience.control.quarantine --backend eks list

The backend is FSDP_DEFAULT_BACKEND's (local by default) unless --backend says otherwise, built
from the same environment as the DAGs' (settings.backend_config): for local, FSDP_RUNS_ROOT and
FSDP_LOCAL_SLOTS; for EKS, the Kubernetes connection of FSDP_KUBERNETES_CONN_ID or
FSDP_EKS_CLUSTER_NAME. The node_maintenance DAG does the same from Airflow.

Exit status: 0 done, 1 the backend refused (an unknown node, no cluster), 2 bad usage (no reason).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from fsdp_resilience.control import settings
from fsdp_resilience.control.backends.base import BackendError, ServiceReturn, TrainingBackend, get_backend


def build_backend(name: str | None) -> TrainingBackend:
    return get_backend(**settings.backend_config(settings.backend_name(name)))


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes = rest // 60
    return f"{days}d{hours:02d}h" if days else f"{hours}h{minutes:02d}m" if hours else f"{minutes}m"


def format_table(nodes: list[dict[str, Any]], now: float | None = None) -> str:
    """The quarantined nodes as a table: node, since (UTC), for how long, reason (and, where the
    backend knows, whether the node is Ready)."""
    if not nodes:
        return "no quarantined nodes"
    now = time.time() if now is None else now
    rows = [("NODE", "SINCE (UTC)", "FOR", "REASON")]
    for q in nodes:
        since = q.get("since")
        reason = q.get("reason") or "(none recorded)"
        if q.get("ready") is False:
            reason += "  [NotReady: its instance is probably being replaced]"
        rows.append(
            (
                q["node_id"],
                time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(since)) if since else "unknown",
                _age(now - since) if since else "-",
                reason,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}" for r in rows)


def format_return(result: ServiceReturn) -> str:
    lines = [f"returned to service: {n}" for n in result.returned]
    lines += [f"{n}: not quarantined, left as it is" for n in result.not_quarantined]
    lines += [
        f"{n}: gone (no such node any more; its Auto Scaling group or Karpenter replaced it): nothing to do"
        for n in result.gone
    ]
    return "\n".join(lines) or "nothing to return"


def parser() -> argparse.ArgumentParser:
    # --backend works before or after the command: the command's copy is left unset unless given.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--backend",
        choices=settings.BACKENDS,
        default=argparse.SUPPRESS,
        help="the backend whose nodes to act on (default: FSDP_DEFAULT_BACKEND, else local)",
    )
    top = argparse.ArgumentParser(
        prog="python -m fsdp_resilience.control.quarantine", description=__doc__.split("\n")[0], parents=[common]
    )
    commands = top.add_subparsers(dest="command", required=True, metavar="{list,return,return-expired}")
    commands.add_parser("list", parents=[common], help="show the quarantined nodes: node, since, reason")
    back = commands.add_parser("return", parents=[common], help="return quarantined nodes to service, with a reason")
    back.add_argument("nodes", nargs="+", metavar="NODE", help="node ids as `list` shows them (local: slot-N)")
    back.add_argument(
        "--reason", required=True, help="what was checked or fixed; recorded with who returned the node and when"
    )
    expired = commands.add_parser(
        "return-expired", parents=[common], help="return the nodes quarantined for longer than the cool-down"
    )
    expired.add_argument(
        "--cooldown-s", type=float, default=None, help="the cool-down in seconds (default: FSDP_QUARANTINE_COOLDOWN_S)"
    )
    return top


def main(argv: list[str] | None = None) -> int:
    top = parser()
    args = top.parse_args(argv)
    try:
        if args.command == "return" and not args.reason.strip():
            top.error(
                "--reason is empty: say what was checked or fixed, e.g. --reason 'GPU reseated, dcgmi diag -r 3 passed'"
            )
        cooldown = None
        if args.command == "return-expired":
            cooldown = settings.quarantine_cooldown_s() if args.cooldown_s is None else args.cooldown_s
            if not cooldown > 0:
                top.error(
                    "the cool-down is 0 (automatic return is off): give --cooldown-s N, or set "
                    "FSDP_QUARANTINE_COOLDOWN_S"
                )
        backend = build_backend(getattr(args, "backend", None))
        if args.command == "list":
            print(format_table(backend.quarantined_nodes()))
        elif args.command == "return":
            print(format_return(backend.return_nodes(args.nodes, args.reason)))
        else:
            returned = backend.return_expired(cooldown)
            print(
                "\n".join(f"returned to service: {n} (quarantined longer than {cooldown:g}s)" for n in returned)
                or f"no node has been quarantined longer than {cooldown:g}s"
            )
    except (BackendError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
