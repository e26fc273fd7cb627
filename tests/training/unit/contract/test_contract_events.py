"""The events log (fsdp_resilience.training.contract.events): append-only, torn lines skipped, never raises."""

import ast
import dataclasses
import functools
from pathlib import Path

from fsdp_resilience.training.contract.events import EVENT_TYPES, Event, EventLog, EventRecord, read_events
from fsdp_resilience.training.contract.rundir import final_status
from fsdp_resilience.training.contract.timeouts import DerivedTimeouts


def test_events_log_appends_and_skips_a_torn_line(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", run_id="r", rank=0)
    log.emit(Event.STEP, step=1, loss=5.0)
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"ts": 1, "event": "st')  # a writer killed mid-line
    log.emit(Event.FINAL, failure_class="success", exit_code=0)
    recs = read_events(tmp_path / "events.jsonl")
    assert [r["event"] for r in recs] == ["step", "final"]
    assert recs[0]["run_id"] == "r" and "host" in recs[0] and "pid" in recs[0]
    assert final_status(tmp_path)["failure_class"] == "success"


def test_events_log_never_raises_when_the_run_dir_is_gone(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    log = EventLog(tmp_path / "file" / "events.jsonl", run_id="r")
    rec = log.emit(Event.FINAL, failure_class="storage_error", exit_code=74)
    assert rec["event"] == "final"
    assert "cannot append" in capsys.readouterr().err


# -- the event types: one TypedDict per kind, complete against the code that writes and reads them --

REPO = Path(__file__).resolve().parents[4]


@functools.cache
def _parsed(folder):
    return [(path, ast.parse(path.read_text())) for path in sorted((REPO / folder).rglob("*.py"))]


def _walk(*folders):
    """(file, node) for every AST node of the Python files under ``folders``."""
    for folder in folders:
        for path, tree in _parsed(folder):
            for node in ast.walk(tree):
                yield path, node


def _event_name(node):
    """The event kind an AST node names: ``Event.X`` (the member's value) or a string constant."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Event":
        member = getattr(Event, node.attr, None)
        return member.value if member is not None else f"Event.{node.attr} (no such member)"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _emits(folder):
    """(file, line, event kind, keyword names) of every ``<log>.emit(kind, ...)`` call under ``folder``."""
    for path, node in _walk(folder):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "emit"
            and node.args
            and _event_name(node.args[0]) is not None
        ):
            yield path, node.lineno, _event_name(node.args[0]), {k.arg for k in node.keywords if k.arg}


def _is_event_field(node):
    """``rec["event"]`` or ``rec.get("event")``."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "event"
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "event"
    )


def _reads(*folders):
    """(file, line, event kind) of every kind the code reads: ``Event.X``, a record's ``event``
    compared with a kind, and the kind passed to ``read_events``."""
    for path, node in _walk(*folders):
        names = []
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Event":
            names.append(_event_name(node))
        elif isinstance(node, ast.Compare) and any(map(_is_event_field, (node.left, *node.comparators))):
            for side in (node.left, *node.comparators):
                items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                names += [n for n in map(_event_name, items) if n and n != "event"]
        elif isinstance(node, ast.Call) and _called(node) == "read_events":
            args = node.args[1:] + [k.value for k in node.keywords if k.arg == "event"]
            names += [n for n in map(_event_name, args) if n]
        for name in names:
            yield path, node.lineno, name


def _called(call):
    return getattr(call.func, "attr", getattr(call.func, "id", ""))


def test_every_event_kind_has_exactly_one_type():
    assert set(EVENT_TYPES) == {e.value for e in Event}
    assert len(set(EVENT_TYPES.values())) == len(EVENT_TYPES)
    for cls in EVENT_TYPES.values():
        assert issubclass(cls, dict) and set(EventRecord.__annotations__) <= set(cls.__annotations__), cls
        assert cls.__doc__, f"{cls.__name__} says what the event means"


def test_every_event_emitted_in_src_is_registered_with_every_field_it_writes():
    emits = list(_emits("src"))
    assert len(emits) >= 20 and {name for *_, name, _ in emits} == set(EVENT_TYPES)  # all found, all emitted
    for path, line, name, keywords in emits:
        where = f"{path.relative_to(REPO)}:{line}"
        assert name in EVENT_TYPES, f"{where} emits {name!r}, which EVENT_TYPES does not know"
        unknown = keywords - set(EVENT_TYPES[name].__annotations__)
        assert not unknown, f"{where} writes {sorted(unknown)} in {name!r}: add them to {EVENT_TYPES[name].__name__}"
    # timeouts_derived carries DerivedTimeouts' fields (emitted as **to_dict())
    derived = {f.name for f in dataclasses.fields(DerivedTimeouts)}
    assert derived <= set(EVENT_TYPES[Event.TIMEOUTS_DERIVED.value].__annotations__)


def test_every_event_read_in_src_and_bench_is_registered():
    reads = list(_reads("src", "bench"))
    assert len(reads) > 20
    unknown = [f"{p.relative_to(REPO)}:{line}: {name}" for p, line, name in reads if name not in EVENT_TYPES]
    assert not unknown, unknown


def test_the_writers_context_fields_are_every_records_fields():
    """What ``EventLog(...)`` and ``.bind(...)`` put in every record is declared in EventRecord."""
    context = set()
    for _, node in _walk("src", "bench"):
        if isinstance(node, ast.Call) and _called(node) in ("EventLog", "bind"):
            context |= {k.arg for k in node.keywords if k.arg}
    assert {"run_id", "rank", "role"} <= context
    assert context <= set(EventRecord.__annotations__), context - set(EventRecord.__annotations__)
