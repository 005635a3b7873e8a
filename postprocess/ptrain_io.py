"""Reading ptrain's output and writing decks: shared by the postprocess scripts and regression/run.

- read_log(path)        out_dir/log.csv -> {column: numpy array} (empty cells are NaN)
- Deck                  a Fortran-namelist deck as ordered groups of (key, raw value text):
                        Deck.read(path), deck.set('group%key', raw), deck.value('group%key'),
                        deck.write(path). Raw value text is kept verbatim, so a deck written
                        back says exactly what the file said (comments are dropped).
- run_dirs(paths)       expand run folders, log.csv files and sweep folders into run folders
- run_labels(dirs)      short labels: the deck keys in which the runs differ
- world_size(deck)      ranks of a resolved deck (dp*tp*pp*cp*ep)
"""
import csv
import itertools
import json
import math
import os
import re

import numpy as np

# --- log.csv -------------------------------------------------------------------------------


def read_log(path):
    """Columns of a ptrain log.csv as float arrays; an empty cell (val_loss when the step did
    not evaluate) is NaN. Accepts the file or the run folder holding it."""
    if os.path.isdir(path):
        path = os.path.join(path, "log.csv")
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        raise ValueError(f"{path}: empty file (no header)")
    header = [h.strip() for h in rows[0]]
    cols = {h: [] for h in header}
    for lineno, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        if len(row) != len(header):
            raise ValueError(f"{path}:{lineno}: {len(row)} fields, header has {len(header)}")
        for h, cell in zip(header, row):
            cell = cell.strip()
            cols[h].append(float(cell) if cell else math.nan)
    return {h: np.array(v, dtype=np.float64) for h, v in cols.items()}


def last_finite(values):
    """The last non-NaN entry of an array, or NaN."""
    finite = np.flatnonzero(np.isfinite(values))
    return float(values[finite[-1]]) if finite.size else math.nan


def steady_mean(values):
    """Mean over the steps after the first (the first carries warm-up costs), as ptrain's own
    summary line does; the only value when there is one step."""
    v = values[np.isfinite(values)]
    if v.size == 0:
        return math.nan
    return float(v[1:].mean()) if v.size > 1 else float(v[0])


# --- decks -----------------------------------------------------------------------------------

_TOKEN = re.compile(r"""
    (?P<str>'(?:[^']|'')*'|"(?:[^"]|"")*")
  | (?P<comment>![^\n]*)
  | (?P<group>&[A-Za-z_]\w*)
  | (?P<slash>/)
  | (?P<eq>=)
  | (?P<comma>,)
  | (?P<lpar>\()
  | (?P<rpar>\))
  | (?P<ws>\s+)
  | (?P<word>[^\s'"=,/()&!]+)
""", re.VERBOSE)


def _tokens(text, path):
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            line = text.count("\n", 0, pos) + 1
            raise ValueError(f"{path}:{line}: cannot read '{text[pos:pos + 20]}'")
        kind = m.lastgroup
        if kind not in ("ws", "comment"):
            yield kind, m.group(), text.count("\n", 0, m.start()) + 1
        pos = m.end()


class Deck:
    """A namelist deck: {group: {key: raw value text}}, in file order. Keys are lower case;
    an element assignment keeps its index in the key ('order(2)')."""

    def __init__(self, groups=None, source=None):
        self.groups = groups if groups is not None else {}
        self.source = source

    @classmethod
    def read(cls, path):
        with open(path) as f:
            return cls.parse(f.read(), path)

    @classmethod
    def parse(cls, text, path="<deck>"):
        toks = list(_tokens(text, path))
        groups = {}
        i = 0
        while i < len(toks):
            kind, val, line = toks[i]
            if kind != "group":
                raise ValueError(f"{path}:{line}: expected '&group', found '{val}'")
            name = val[1:].lower()
            items = groups.setdefault(name, {})
            i += 1
            key = None
            while True:
                if i >= len(toks):
                    raise ValueError(f"{path}: group &{name} has no closing '/'")
                kind, val, line = toks[i]
                if kind == "slash" or (kind == "group" and val.lower() == "&end"):
                    i += 1
                    break
                # A key: word [ '(' index ')' ] '='
                j = i
                if kind == "word":
                    k = val.lower()
                    j = i + 1
                    if j + 2 < len(toks) and toks[j][0] == "lpar" and toks[j + 2][0] == "rpar":
                        k += "(" + toks[j + 1][1] + ")"
                        j += 3
                    if j < len(toks) and toks[j][0] == "eq":
                        key = k
                        if key in items:
                            raise ValueError(f"{path}:{line}: {name}%{key} is set twice")
                        items[key] = []
                        i = j + 1
                        continue
                if key is None:
                    raise ValueError(f"{path}:{line}: expected 'key =' in &{name}, found '{val}'")
                if kind in ("str", "word"):
                    items[key].append(val)
                elif kind != "comma":
                    raise ValueError(f"{path}:{line}: unexpected '{val}' in &{name}%{key}")
                i += 1
        deck = cls({g: {k: ", ".join(v) for k, v in kv.items()} for g, kv in groups.items()},
                   source=path)
        return deck

    @staticmethod
    def split_key(dotted):
        if "%" not in dotted:
            raise ValueError(f"'{dotted}': a deck key is written group%key")
        group, key = dotted.split("%", 1)
        return group.strip().lower(), key.strip().lower()

    def raw(self, dotted, default=None):
        group, key = self.split_key(dotted)
        return self.groups.get(group, {}).get(key, default)

    def value(self, dotted, default=None):
        """The value as Python: str, bool, int, float, or a list of them for arrays."""
        raw = self.raw(dotted)
        return default if raw is None else parse_value(raw)

    def set(self, dotted, raw):
        """Set group%key to raw value text (as after '=' in a deck), replacing the key and
        any element assignments of it."""
        group, key = self.split_key(dotted)
        items = self.groups.setdefault(group, {})
        if "(" not in key:  # the whole array replaces its element assignments
            for k in [k for k in items if k.startswith(key + "(")]:
                del items[k]
        items[key] = raw  # in place when the key was there

    def text(self, header=""):
        out = [header.rstrip("\n")] if header else []
        for group, items in self.groups.items():
            out.append(f"&{group}")
            width = max((len(k) for k in items), default=0)
            out += [f"  {k:<{width}} = {v}" for k, v in items.items()]
            out.append("/")
        return "\n".join(out) + "\n"

    def write(self, path, header=""):
        with open(path, "w") as f:
            f.write(self.text(header))


_INT = re.compile(r"^[+-]?\d+$")
_REAL = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eEdD][+-]?\d+)?$")
_LOGICAL = {".true.": True, ".false.": False, ".t.": True, ".f.": False}


def _scalar(tok):
    t = tok.strip()
    if t[:1] in "'\"":
        q = t[0]
        return t[1:-1].replace(q + q, q)
    if t.lower() in _LOGICAL:
        return _LOGICAL[t.lower()]
    if _INT.match(t):
        return int(t)
    if _REAL.match(t):
        return float(re.sub("[dD]", "e", t))
    return t


def parse_value(raw):
    """Raw value text -> Python; 'n*v' repeats, several values make a list."""
    vals = []
    for m in re.finditer(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|[^,\s]+", raw):
        tok = m.group()
        rep = re.match(r"^(\d+)\*(.+)$", tok)
        if rep and tok[:1] not in "'\"":
            vals += [_scalar(rep.group(2))] * int(rep.group(1))
        else:
            vals.append(_scalar(tok))
    return vals[0] if len(vals) == 1 else vals


def format_value(text):
    """A value as the user wrote it on a command line -> raw deck text: numbers, logicals
    and quoted strings stay; a bare word becomes a quoted string (fp64 -> 'fp64')."""
    t = text.strip()
    if not t:
        raise ValueError("empty value")
    if t[:1] in "'\"" or t.lower() in _LOGICAL or _INT.match(t) or _REAL.match(t):
        return t
    return quote(t)


def quote(text):
    """A Python string as a deck string literal."""
    return "'" + text.replace("'", "''") + "'"


def split_values(text):
    """'1,2,4' -> ['1', '2', '4']; commas inside quotes do not split."""
    return [m.group().strip() for m in
            re.finditer(r"(?:'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|[^,])+", text)]


def world_size(deck):
    """Ranks of a resolved deck (out_dir/deck.nml, where dp is resolved)."""
    n = 1
    for axis in ("dp", "tp", "pp", "cp", "ep"):
        v = deck.value(f"parallel%{axis}", 1)
        n *= v if isinstance(v, int) and v > 0 else 1
    return n


# --- runs ------------------------------------------------------------------------------------


def read_sweep(folder):
    """The sweep.json that sweep.py writes, or None."""
    path = os.path.join(folder, "sweep.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def run_dirs(paths):
    """Run folders from arguments that are run folders, log.csv files or sweep folders (every
    run of the sweep that has a log.csv)."""
    out = []
    for p in paths:
        if os.path.isfile(p):
            out.append(os.path.dirname(os.path.abspath(p)))
            continue
        sweep = read_sweep(p)
        if sweep is not None:
            out += [r["out_dir"] for r in sweep["runs"]
                    if os.path.isfile(os.path.join(r["out_dir"], "log.csv"))]
        elif os.path.isfile(os.path.join(p, "log.csv")):
            out.append(os.path.abspath(p))
        else:
            raise FileNotFoundError(f"{p}: neither a run folder with log.csv nor a sweep folder")
    return out


_NOT_LABELS = {"run%out_dir", "run%name", "checkpoint%dir", "model%init_from"}


def run_labels(dirs):
    """Labels for runs: the resolved-deck keys whose values differ between them
    ('tp=2 micro_batch=4'; with the group when a key name is ambiguous); the folder names
    when that says nothing."""
    decks = []
    for d in dirs:
        path = os.path.join(d, "deck.nml")
        decks.append(Deck.read(path) if os.path.isfile(path) else None)
    if len(dirs) > 1 and all(decks):
        keys = sorted({f"{g}%{k}" for dk in decks for g, kv in dk.groups.items() for k in kv})
        varying = [k for k in keys if k not in _NOT_LABELS
                   and len({dk.raw(k) for dk in decks}) > 1]
        if varying:
            short = [k.split("%", 1)[1] for k in varying]  # 'tp' for 'parallel%tp' when unique
            names = short if len(set(short)) == len(short) else varying
            labels = [" ".join(f"{n}={dk.raw(k)}" for n, k in zip(names, varying))
                      for dk in decks]
            if len(set(labels)) == len(labels):
                return labels
    names = [os.path.basename(os.path.normpath(d)) for d in dirs]
    if len(set(names)) == len(names):
        return names
    return [os.path.relpath(d) for d in dirs]


def product(ranges):
    """Cartesian product of [(key, [values])], the last key varying fastest."""
    keys = [k for k, _ in ranges]
    for combo in itertools.product(*[v for _, v in ranges]):
        yield dict(zip(keys, combo))
