"""Run docs/guide.md's shell commands as written, in order, on a fresh clone of the repository's committed HEAD.

Every ```bash block of the guide runs, each command in the clone's root, unless the line just above the block says
why it cannot run here:

    <!-- guide-check: skip (needs a GPU) -->

The commands use the environment this script runs in: PYTHONPATH names the clone, in place of the `pip install -e .`
a user would run there (nothing is installed or downloaded). One line per command (ok, failed or skipped, seconds),
a summary, exit status 1 if any command failed; `--out` writes the results as JSON.

    python scripts/check_guide.py [--timeout SECONDS] [--out results.json] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = "docs/guide.md"
MARKER = re.compile(r"<!-- guide-check: skip \((.+)\) -->")


@dataclass
class Command:
    line: int  # where the command starts in the guide
    text: str  # as written, continuation lines included
    skip: str | None = None  # why it does not run here


@dataclass
class Result:
    line: int
    command: str
    status: str  # ok, failed, skipped
    seconds: float | None = None
    reason: str | None = None  # a skip's reason, a failure's exit status or timeout
    output_tail: str | None = None  # the last lines a failed command printed


def commands(guide: str) -> list[Command]:
    """The commands of the guide's ```bash blocks in order: continuation lines joined, comment lines left out, each
    with the reason of the skip marker above its block, if there is one."""
    lines = guide.splitlines()
    found = []
    for i, line in enumerate(lines):
        # a marker misspelt, or above anything but a bash block, would let a block run or skip unnoticed
        misplaced = not MARKER.fullmatch(line) or lines[i + 1:i + 2] != ["```bash"]
        if line.startswith("<!--") and "guide-check" in line and misplaced:
            raise ValueError(f"{GUIDE}:{i + 1}: a skip marker is `<!-- guide-check: skip (why) -->` on the line above "
                             f"a ```bash block, not {line!r}")
        if line != "```bash":
            continue
        marker = MARKER.fullmatch(lines[i - 1]) if i else None
        end = lines.index("```", i + 1)  # ValueError for a block never closed
        start, text = i + 2, ""  # line numbers count from 1, as an editor's do
        for number, body_line in enumerate(lines[i + 1:end], i + 2):
            text += body_line + "\n"
            if body_line.endswith("\\"):  # continued on the next line
                continue
            if text.strip() and not text.lstrip().startswith("#"):
                found.append(Command(start, text.rstrip("\n"), marker.group(1) if marker else None))
            start, text = number + 1, ""
    return found


def run(command: Command, cwd: Path, env: dict[str, str], timeout: float, log: Path) -> Result:
    """Run one command with bash in `cwd`, its output into `log`; on timeout its whole process group goes (the ranks
    it forked included)."""
    if command.skip:
        return Result(command.line, command.text, "skipped", reason=command.skip)
    start = time.monotonic()
    with log.open("w") as out:
        # a session of its own, so that a timeout ends every process the command started; no input to wait for
        process = subprocess.Popen(["bash", "-c", command.text], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            process.wait(timeout=timeout)
            reason = f"exit status {process.returncode}" if process.returncode else None
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # every process of it may have ended meanwhile
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            reason = f"timed out after {timeout:g} s"
    seconds = round(time.monotonic() - start, 1)
    if reason is None:
        return Result(command.line, command.text, "ok", seconds)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    return Result(command.line, command.text, "failed", seconds, reason, tail)


def report(result: Result) -> str:
    seconds = "-" if result.seconds is None else f"{result.seconds:.1f} s"
    why = f"  ({result.reason})" if result.reason else ""
    return f"{result.status:<8} {seconds:>9}  {GUIDE}:{result.line}  {' '.join(result.command.split())}{why}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=900, help="seconds each command may take (default 900)")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the clone and each command's output")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="check_guide_"))
    clone = work / "repo"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True,
                            check=True).stdout.strip()
    print(f"{GUIDE} of {commit[:12]}, cloned into {clone}", flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(clone), os.environ.get("PYTHONPATH")]))}

    logs = work / "logs"
    logs.mkdir()
    results = []
    start = time.monotonic()
    for command in commands((clone / GUIDE).read_text()):
        results.append(run(command, clone, env, args.timeout, logs / f"guide-line-{command.line}.log"))
        print(report(results[-1]), flush=True)
        if results[-1].output_tail:
            print("    " + results[-1].output_tail.replace("\n", "\n    "), flush=True)
    total = round(time.monotonic() - start, 1)

    counts = {status: sum(r.status == status for r in results) for status in ("ok", "failed", "skipped")}
    print(f"{counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} skipped in {total:.1f} s")
    if args.out:
        args.out.write_text(json.dumps({"commit": commit, "total_s": total, **counts,
                                        "results": [asdict(r) for r in results]}, indent=2) + "\n")
    if args.keep:
        print(f"the clone stays in {clone}, each command's output in {logs}")
    else:
        shutil.rmtree(work)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
