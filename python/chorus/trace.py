"""python -m chorus.trace DIR: reads the flight records that Chorus ranks wrote into DIR
(CHORUS_TRACE_DIR: on a failed or timed-out operation, on CHORUS_TRACE_SIGNAL, or through
chorus.dump_trace()), lines them up per communicator by collective sequence number, and
says which rank is behind, at which sequence number, in which operation; then a compact
table per communicator.

Exit status: 0 when every communicator's ranks agree (no rank behind, no mismatched call,
no missing record), 1 when a straggler, a mismatch or a missing rank was found, 2 when DIR
holds no readable record (or on bad arguments)."""
import argparse
import collections
import glob
import json
import os
import sys
import time

FORMAT = "chorus-flight-recorder"
SHORT = {"all_reduce": "AR", "broadcast": "BC", "reduce": "RD", "all_gather": "AG",
         "reduce_scatter": "RS", "gather": "GA", "scatter": "SC", "all_to_all": "A2A",
         "barrier": "BAR", "send": "SEND", "recv": "RECV"}
MARK = {"done": "ok", "started": "RUN", "failed": "FAIL", "queued": "q"}


def load(directory):
    """Every record in directory: (records, problems). A record is the file's JSON dict with
    '_path' added; problems lists files that could not be read."""
    records, problems = [], []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        try:
            with open(path) as f:
                rec = json.load(f)
        except (OSError, ValueError) as e:
            problems.append(f"{path}: unreadable ({e})")
            continue
        if not isinstance(rec, dict) or rec.get("format") != FORMAT:
            continue
        rec["_path"] = path
        records.append(rec)
    return records, problems


def comm_key(rec):
    return (rec.get("comm") or "", rec.get("prefix") or "", int(rec["world"]))


def _fmt_time(wall):
    if wall is None:
        return "-"
    return time.strftime("%H:%M:%S", time.localtime(wall)) + f".{int(wall * 1000) % 1000:03d}"


def _ranks(ranks):
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _signature(e):
    return (e["op"], e["count"], e["dtype"], e.get("redop"), e.get("root"))


def _describe_call(e):
    text = f"{e['op']} ({e['count']} x {e['dtype']}"
    if e.get("redop"):
        text += f" {e['redop']}"
    if e.get("root") is not None:
        text += f" root {e['root']}"
    return text + ")"


class CommView:
    """One communicator: the latest record of each of its ranks."""

    def __init__(self, key, recs):
        self.name, self.prefix, self.world = key
        by_rank = {}
        for r in recs:
            old = by_rank.get(r["rank"])
            if old is None or r.get("dumped_wall", 0) > old.get("dumped_wall", 0):
                by_rank[r["rank"]] = r
        self.by_rank = by_rank
        self.missing = [r for r in range(self.world) if r not in by_rank]
        self.global_ranks = None
        for r in by_rank.values():
            if r.get("global_ranks"):
                self.global_ranks = r["global_ranks"]
        # per rank: seq -> collective entry
        self.colls = {}
        for rank, rec in by_rank.items():
            seqs = {}
            for e in rec.get("entries", []):
                if e.get("p2p") or e.get("seq") is None:
                    continue
                seqs[e["seq"]] = e
            self.colls[rank] = seqs

    def label(self):
        name = self.name or self.prefix or "?"
        return f"communicator {name!r} ({self.world} ranks)"

    def who(self, rank):
        if self.global_ranks and rank < len(self.global_ranks) and self.global_ranks[rank] != rank:
            return f"rank {rank} (global {self.global_ranks[rank]})"
        return f"rank {rank}"

    def last_done(self, rank):
        done = [s for s, e in self.colls[rank].items() if e["state"] == "done"]
        return max(done) if done else None

    def analyze(self):
        """Findings: a list of dicts {kind, rank(s), seq, text}; empty when all agree."""
        findings = []
        present = sorted(self.by_rank)
        if not present:
            return findings
        # the window every present rank still holds (rings forget the oldest operations)
        lows = [min(s) for s in self.colls.values() if s]
        low = max(lows) if lows else 0
        highs = [max(s) for s in self.colls.values() if s]
        high = max(highs) if highs else -1
        high = max([high] + [int(self.by_rank[r].get("next_seq", 0)) - 1 for r in present])
        first_bad = None
        for seq in range(low, high + 1):
            entries = {r: self.colls[r].get(seq) for r in present}
            if any(e is None or e["state"] != "done" for e in entries.values()) \
                    or len({_signature(e) for e in entries.values()}) > 1:
                first_bad = seq
                break
        if first_bad is None:
            if self.missing:
                findings.append(self._missing_finding(None))
            return findings
        seq = first_bad
        entries = {r: self.colls[r].get(seq) for r in present}
        reached = {r: e for r, e in entries.items() if e is not None}
        never = [r for r, e in entries.items() if e is None]
        # the call most ranks made at this sequence number is the reference
        sigs = collections.Counter(_signature(e) for e in reached.values())
        majority = None
        if sigs:
            top = sigs.most_common()
            if len(top) == 1 or top[0][1] > top[1][1]:
                majority = top[0][0]
        ref = next((e for e in reached.values() if majority and _signature(e) == majority), None)
        started = {r: e for r, e in reached.items() if e.get("started_wall") is not None}
        if never and ref is not None:
            others = [r for r in started if _signature(started[r]) == majority]
            when = min((started[r]["started_wall"] for r in others), default=None)
            for r in never:
                last = self.last_done(r)
                rec = self.by_rank[r]
                text = (f"{self.who(r)} never started {ref['op']} seq {seq}"
                        + (f" ({_ranks(others)} started it at {_fmt_time(when)})" if others else "")
                        + f"; {self.who(r)} last completed seq "
                        + (str(last) if last is not None else "(none recorded)")
                        + f", issued {rec.get('next_seq', '?')} collectives in all")
                findings.append(dict(kind="behind", rank=r, seq=seq, op=ref["op"], text=text))
        if majority is not None:
            odd = [r for r, e in reached.items() if _signature(e) != majority]
            ends = [x.get("ended_wall") for rr, x in reached.items()
                    if rr not in odd and x.get("ended_wall") is not None]
            others = [x for x in reached if x not in odd]
            for r in odd:
                e = reached[r]
                last = self.last_done(r)
                last_text = (f"{self.who(r)} last completed seq "
                             + (str(last) if last is not None else "(none recorded)"))
                if e.get("started_wall") and ends and e["started_wall"] > max(ends):
                    # it came to this sequence number only after the others had given up on
                    # it: behind, not a concurrent disagreement
                    when = min((reached[x]["started_wall"] for x in others
                                if reached[x].get("started_wall") is not None), default=None)
                    text = (f"{self.who(r)} never started {ref['op']} seq {seq} ({_ranks(others)} "
                            f"started it at {_fmt_time(when)}); {last_text}; it called "
                            f"{_describe_call(e)} as seq {seq} only at "
                            f"{_fmt_time(e['started_wall'])}, "
                            f"{e['started_wall'] - max(ends):.1f} s after the others had "
                            f"{'failed' if any(reached[x]['state'] == 'failed' for x in others) else 'ended'}")
                    findings.append(dict(kind="behind", rank=r, seq=seq, op=ref["op"], text=text,
                                         called=e["op"]))
                    continue
                text = (f"{self.who(r)} called {_describe_call(e)} as seq {seq} where "
                        f"{_ranks(others)} called {_describe_call(ref)}; {last_text}")
                findings.append(dict(kind="mismatch", rank=r, seq=seq, op=e["op"],
                                     expected=ref["op"], text=text))
        elif len(sigs) > 1:
            parts = "; ".join(f"{_ranks([r for r, e in reached.items() if _signature(e) == s])}"
                              f" called {_describe_call(next(e for e in reached.values() if _signature(e) == s))}"
                              for s in sigs)
            findings.append(dict(kind="mismatch", rank=None, seq=seq, op=None,
                                 text=f"ranks disagree at seq {seq} with no majority: {parts}"))
        if not findings and reached:
            waiting = [r for r, e in reached.items() if e["state"] in ("started", "queued", "failed")]
            if waiting and not self.missing:
                op = next(iter(reached.values()))["op"]
                findings.append(dict(
                    kind="stuck", rank=None, seq=seq, op=op,
                    text=f"every rank reached {op} seq {seq}, {_ranks(waiting)} did not complete "
                         f"it: the failure is inside the operation (see the errors below)"))
        if self.missing:
            findings.append(self._missing_finding(seq))
        return findings

    def _missing_finding(self, seq):
        where = f" (the others stopped at seq {seq})" if seq is not None else ""
        text = (f"{_ranks(self.missing)} wrote no record{where}: killed (SIGKILL) or stopped "
                "before a dump, or CHORUS_TRACE_DIR differs there; treat "
                + ("it" if len(self.missing) == 1 else "them") + " as the likely straggler")
        return dict(kind="missing", rank=self.missing[0] if len(self.missing) == 1 else None,
                    ranks=self.missing, seq=seq, op=None, text=text)

    def table(self, around=None, width=5):
        """Rank summary, then the state of each rank per sequence number near `around`."""
        lines = [f"  {'rank':>4} {'global':>6} {'host':<16} {'pid':>7} {'reason':<8} "
                 f"{'next':>5} {'done':>5}  error"]
        for r in range(self.world):
            rec = self.by_rank.get(r)
            if rec is None:
                lines.append(f"  {r:>4} {'-':>6} {'(no record)':<16}")
                continue
            last = self.last_done(r)
            err = (rec.get("error") or "").replace("\n", " ")
            if len(err) > 100:
                err = err[:97] + "..."
            lines.append(f"  {r:>4} {rec.get('global_rank', r):>6} {str(rec.get('host'))[:16]:<16} "
                         f"{rec.get('pid', 0):>7} {str(rec.get('reason'))[:8]:<8} "
                         f"{rec.get('next_seq', '?'):>5} {('-' if last is None else last):>5}  {err}")
        seqs = sorted({s for c in self.colls.values() for s in c})
        if seqs:
            if around is None:
                around = seqs[-1]
            window = [s for s in seqs if around - width <= s <= around + 2]
            lines.append("")
            lines.append("  " + f"{'seq':>5}  " + " ".join(f"{'r' + str(r):>9}" for r in range(self.world)))
            for s in window:
                cells = []
                for r in range(self.world):
                    e = self.colls.get(r, {}).get(s)
                    cells.append(f"{'-' if e is None else SHORT.get(e['op'], e['op'][:4]) + ':' + MARK.get(e['state'], e['state']):>9}")
                lines.append("  " + f"{s:>5}  " + " ".join(cells))
        return "\n".join(lines)


def analyze_dir(directory):
    """(views, findings, problems) for every communicator found in directory."""
    records, problems = load(directory)
    groups = collections.defaultdict(list)
    for r in records:
        groups[comm_key(r)].append(r)
    views, findings = [], []
    for key in sorted(groups, key=lambda k: (k[0], k[1])):
        v = CommView(key, groups[key])
        views.append(v)
        for f in v.analyze():
            f["comm"] = v.name or v.prefix
            findings.append(f)
    return views, findings, problems


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m chorus.trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="directory of flight records (CHORUS_TRACE_DIR)")
    ap.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.dir):
        print(f"chorus.trace: {args.dir} is not a directory", file=sys.stderr)
        return 2
    views, findings, problems = analyze_dir(args.dir)
    if not views:
        print(f"chorus.trace: no flight record in {args.dir}", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"findings": findings, "problems": problems,
                          "communicators": [dict(name=v.name, prefix=v.prefix, world=v.world,
                                                 ranks=sorted(v.by_rank), missing=v.missing)
                                            for v in views]}, indent=1))
        return 1 if findings else 0
    for v in views:
        own = [f for f in findings if f["comm"] == (v.name or v.prefix)]
        print(f"{v.label()}: records of {_ranks(v.by_rank) if v.by_rank else 'no rank'}")
        if not own:
            print("  all ranks agree: no rank behind, no mismatched call")
        for f in own:
            print(f"  {f['text']}")
        seqs = [f["seq"] for f in own if f.get("seq") is not None]
        print(v.table(around=min(seqs) if seqs else None))
        print()
    for p in problems:
        print(f"warning: {p}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
