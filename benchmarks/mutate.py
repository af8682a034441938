"""Mutation testing of one module against its unit tests (session 49; docs/status.md #16): where the suite lets a
change to the code pass. Preloads the heavy imports once, forks per mutant, patches the module in memory (rebinding
its functions and classes wherever they were imported) and runs pytest.main in the child. Mutations: comparisons,
arithmetic, constants +-1, and/or, `not`, `if` forced True/False, branch swaps, `raise` -> `pass`, early `return
None`, min <-> max. A mutant on a line the tests never run is "uncovered" (not run with --skip-uncovered); a
timeout counts as killed. Run from the repository root, one job at a time (a mutant of a planner module: 1-10 s).

Not valid for a module that other modules use at import time (session 53, config_fields.py): re-running its source
empties its registries (config_fields.SECTIONS: every mutant then "killed" by the lost "did you mean" hint), and
functions that pydantic captured in another module's classes (field validators) are never mutated. The baseline
therefore runs twice: the tests as they are (coverage), then the unmutated source re-run as a mutant is; either
failing stops the run.

    python benchmarks/mutate.py raytrain/planning/choose.py --tests tests/unit/planning/test_choose.py \
        --skip-uncovered --out /tmp/choose.jsonl
    python benchmarks/mutate.py raytrain/config.py --tests tests/unit/test_config.py --list   # the mutants only

usage: mutate.py MODULE_FILE --tests T1 [T2..] [--k EXPR] [--funcs f1,f2] [--lines a-b] [--timeout S]
                 [--out results.jsonl] [--preload m1,m2] [--list] [--only ids] [--nocov]
"""
import argparse
import ast
import importlib
import inspect
import json
import os
import signal
import sys
import tempfile
import time

REPO = os.environ.get("MUT_REPO", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mutations_for(node):
    """(description, apply(node) -> replacement node or None for in-place) options for one node."""
    out = []
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        swaps = {ast.Lt: [ast.LtE, ast.Gt], ast.LtE: [ast.Lt, ast.Gt], ast.Gt: [ast.GtE, ast.Lt],
                 ast.GtE: [ast.Gt, ast.Lt], ast.Eq: [ast.NotEq], ast.NotEq: [ast.Eq], ast.In: [ast.NotIn],
                 ast.NotIn: [ast.In], ast.Is: [ast.IsNot], ast.IsNot: [ast.Is]}
        for new in swaps.get(type(node.ops[0]), []):
            out.append((f"{type(node.ops[0]).__name__}->{new.__name__}",
                        lambda n, new=new: setattr(n, "ops", [new()])))
    elif isinstance(node, ast.BinOp):
        swaps = {ast.Add: [ast.Sub], ast.Sub: [ast.Add], ast.Mult: [ast.Div], ast.Div: [ast.Mult],
                 ast.FloorDiv: [ast.Mult], ast.Mod: [ast.FloorDiv], ast.Pow: [ast.Mult]}
        if not (isinstance(node.op, ast.Mod) and isinstance(node.left, (ast.Constant, ast.JoinedStr))):
            for new in swaps.get(type(node.op), []):
                out.append((f"{type(node.op).__name__}->{new.__name__}",
                            lambda n, new=new: setattr(n, "op", new())))
    elif isinstance(node, ast.BoolOp):
        new = ast.Or if isinstance(node.op, ast.And) else ast.And
        out.append((f"{type(node.op).__name__}->{new.__name__}", lambda n, new=new: setattr(n, "op", new())))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        out.append(("drop not", lambda n: n.operand))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        out.append(("drop -", lambda n: n.operand))
    elif isinstance(node, ast.Constant) and type(node.value) in (int, float, bool):
        v = node.value
        if isinstance(v, bool):
            out.append((f"{v}->{not v}", lambda n: setattr(n, "value", not n.value)))
        elif isinstance(v, int):
            out.append((f"{v}->{v + 1}", lambda n: setattr(n, "value", n.value + 1)))
            if v not in (0, 1):
                out.append((f"{v}->{v - 1}", lambda n: setattr(n, "value", n.value - 1)))
        else:
            out.append((f"{v}->{v * 2 if v else 1.0}", lambda n: setattr(n, "value", n.value * 2 if n.value else 1.0)))
            if v:
                out.append((f"{v}->{v / 2}", lambda n: setattr(n, "value", n.value / 2)))
    elif isinstance(node, ast.If):
        out.append(("if->False", lambda n: setattr(n, "test", ast.Constant(False))))
        out.append(("if->True", lambda n: setattr(n, "test", ast.Constant(True))))
    elif isinstance(node, ast.IfExp):
        out.append(("ifexp->body", lambda n: n.body))
        out.append(("ifexp->orelse", lambda n: n.orelse))
    elif isinstance(node, ast.Raise):
        out.append(("raise->pass", lambda n: ast.Pass()))
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
        new = "max" if node.func.id == "min" else "min"
        out.append((f"{node.func.id}->{new}", lambda n, new=new: setattr(n.func, "id", new)))
    elif isinstance(node, ast.Return) and node.value is not None and not (
            isinstance(node.value, ast.Constant) and node.value.value is None):
        out.append(("return None", lambda n: setattr(n, "value", ast.Constant(None))))
    return out


def skip_node(node, parents):
    # never mutate docstrings / f-string internals / annotations / decorators
    p = parents.get(id(node))
    while p is not None:
        if isinstance(p, (ast.JoinedStr, ast.FormattedValue)):
            return True
        if isinstance(p, ast.arg) or (isinstance(p, ast.AnnAssign) and node is p.annotation):
            return True
        p = parents.get(id(p))
    return False


def parsed(src):
    """(tree, its nodes in ast.walk's order: a mutant's `idx`, each node's parent by id)."""
    tree = ast.parse(src)
    nodes = list(ast.walk(tree))
    parents = {id(c): n for n in nodes for c in ast.iter_child_nodes(n)}
    return tree, nodes, parents


def enumerate_mutants(src, funcs=None, lines=None, covered=None):
    tree, nodes, parents = parsed(src)
    func_ranges = [(n.lineno, n.end_lineno, n.name) for n in nodes if isinstance(n, (ast.FunctionDef,
                                                                                    ast.AsyncFunctionDef))]

    def func_of(line):
        best = None
        for a, b, name in func_ranges:
            if a <= line <= b and (best is None or a >= best[0]):
                best = (a, b, name)
        return best[2] if best else "<module>"

    muts = []
    for i, n in enumerate(nodes):
        if not hasattr(n, "lineno") or skip_node(n, parents):
            continue
        fn = func_of(n.lineno)
        if funcs and fn not in funcs:
            continue
        if lines and not (lines[0] <= n.lineno <= lines[1]):
            continue
        if covered is not None and n.lineno not in covered and fn != "<module>":
            cov = False
        else:
            cov = True
        for j, (desc, _) in enumerate(mutations_for(n)):
            muts.append(dict(id=len(muts), idx=i, opt=j, line=n.lineno, col=n.col_offset, func=fn, desc=desc,
                             covered=cov))
    return muts


def build(src, m):
    tree, nodes, parents = parsed(src)
    target = nodes[m["idx"]]
    _, fn = mutations_for(target)[m["opt"]]
    rep = fn(target)
    if isinstance(rep, ast.AST):
        parent = parents[id(target)]
        for field, value in ast.iter_fields(parent):
            if value is target:
                setattr(parent, field, rep)
            elif isinstance(value, list):
                for k, v in enumerate(value):
                    if v is target:
                        value[k] = rep
        ast.copy_location(rep, target)
    ast.fix_missing_locations(tree)
    return tree


def patch_module(modname, code):
    mod = sys.modules[modname]
    old = dict(mod.__dict__)
    exec(code, mod.__dict__)
    for k, v_old in old.items():
        v_new = mod.__dict__.get(k)
        if v_new is v_old or not (inspect.isfunction(v_old) or inspect.isclass(v_old)):
            continue
        if getattr(v_old, "__module__", None) != modname:
            continue
        for m in list(sys.modules.values()):
            d = getattr(m, "__dict__", None)
            if not d or m is mod:
                continue
            for attr, val in list(d.items()):
                if val is v_old:
                    setattr(m, attr, v_new)


def run_child(modname, code, pytest_args, trace_file=None):
    import pytest
    if not os.environ.get("MUT_VERBOSE"):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    try:
        if code is not None:
            patch_module(modname, code)
        if trace_file:
            target = sys.modules[modname].__file__
            hit = set()

            def tracer(frame, event, arg):
                if frame.f_code.co_filename != target:
                    return None

                def local(frame, event, arg):
                    if event == "line":
                        hit.add(frame.f_lineno)
                    return local
                hit.add(frame.f_lineno)
                return local
            sys.settrace(tracer)
            import threading
            threading.settrace(tracer)
        rc = pytest.main(pytest_args)
        if trace_file:
            sys.settrace(None)
            with open(trace_file, "w") as f:
                json.dump(sorted(hit), f)
    except BaseException:
        rc = 99
    os._exit(int(rc) if int(rc) < 256 else 98)


def fork_run(modname, code, pytest_args, timeout, trace_file=None):
    t0 = time.time()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        run_child(modname, code, pytest_args, trace_file)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), time.time() - t0
        if time.time() - t0 > timeout:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return "timeout", time.time() - t0
        time.sleep(0.05)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("module")
    ap.add_argument("--tests", nargs="+", required=True)
    ap.add_argument("--k")
    ap.add_argument("--funcs")
    ap.add_argument("--lines")
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--out")
    ap.add_argument("--preload", default="")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--only")
    ap.add_argument("--nocov", action="store_true")
    ap.add_argument("--skip-uncovered", action="store_true")
    ap.add_argument("--warm", action="store_true")
    ap.add_argument("--nobase", action="store_true")
    a = ap.parse_args()
    os.chdir(REPO)
    sys.path.insert(0, REPO)
    modname = a.module.removesuffix(".py").replace("/", ".")
    importlib.import_module(modname)
    for p in filter(None, a.preload.split(",")):
        importlib.import_module(p)
    import pytest  # noqa: F401
    src = open(a.module).read()
    pytest_args = [*a.tests, "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    if a.k:
        pytest_args += ["-k", a.k]
    funcs = set(a.funcs.split(",")) if a.funcs else None
    lines = tuple(int(x) for x in a.lines.split("-")) if a.lines else None
    covered, timeout = None, a.timeout
    if a.warm and not a.list:
        saved = os.dup(1), os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        t0 = time.time()
        wrc = pytest.main(pytest_args)
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        print(f"warm rc={wrc} {time.time() - t0:.1f}s", flush=True)
    if not a.list and not a.nobase:
        tf = os.path.join(tempfile.gettempdir(), f"raytrain-mutate-cov-{os.getpid()}.json")
        rc, dt = fork_run(modname, None, pytest_args, 600, trace_file=None if a.nocov else tf)
        print(f"baseline rc={rc} {dt:.1f}s", flush=True)
        if rc != 0:
            sys.exit("baseline fails")
        # The unmutated source re-run as every mutant is (exec into the module, functions rebound): a module whose
        # re-run alone fails the tests (a registry emptied, a class that other modules hold already) would "kill"
        # every mutant (session 62: config_files.py with three test files together). One more run of the tests.
        rc, dt = fork_run(modname, compile(src, os.path.abspath(a.module), "exec"), pytest_args, 600)
        print(f"baseline re-run rc={rc} {dt:.1f}s", flush=True)
        if rc != 0:
            sys.exit("the module's own source, re-run as a mutant is, fails these tests: every kill would be false "
                     "(see this file's docstring; try the test files one at a time)")
        if not a.nocov:
            covered = set(json.load(open(tf)))
        timeout = min(a.timeout, max(3 * dt, 10)) if a.nocov else a.timeout
    muts = enumerate_mutants(src, funcs, lines, covered)
    if a.only:
        ids = {int(x) for x in a.only.split(",")}
        muts = [m for m in muts if m["id"] in ids]
    if a.list:
        for m in muts:
            print(m)
        print(len(muts), "mutants")
        return
    out = open(a.out, "a") if a.out else None
    counts = {}
    for m in muts:
        if not m["covered"] and a.skip_uncovered:
            res, dt = "uncovered", 0.0
        else:
            try:
                code = compile(build(src, m), os.path.abspath(a.module), "exec")
            except Exception as e:  # noqa: BLE001
                res, dt = f"compile-error {e}", 0.0
            else:
                rc, dt = fork_run(modname, code, pytest_args, timeout)
                res = "survived" if rc == 0 else "timeout" if rc == "timeout" else "killed"
        counts[res.split()[0]] = counts.get(res.split()[0], 0) + 1
        rec = {**m, "result": res, "secs": round(dt, 1)}
        line = src.splitlines()[m["line"] - 1].strip()
        print(f"{m['id']:4d} {res:9s} {dt:5.1f}s L{m['line']} {m['func']}: {m['desc']} | {line[:90]}", flush=True)
        if out:
            out.write(json.dumps(rec) + "\n")
            out.flush()
    print(counts)


if __name__ == "__main__":
    main()
