"""``%%profile_gpu``: the cell under torch.profiler; where the time goes and what to change."""

from __future__ import annotations

import ast
import re

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..device import dtype_name
from ..options import a_type, magic_spelled, magic_spelling
from ..profile import PROFILE_MAGIC, ProfileResult, _nested, profile_function
from ..profile_compare import compare_profiles
from ..profile_options import DTYPES, FILTER_HELP, ProfileError, ProfileOptions, validate
from ..op_attribution import cell_line_label
from ..profile_table import SORT_COLUMNS
from .common import (cell_function, cell_number, check_name, check_name_free, comment_hinted, compile_cell, dtype_hint,
                     help_option, interrupt_without_frames, interrupted_in_nbaccel, output_can_be_silenced, parse_cell,
                     parse_line, refuse_empty_cell, refuse_options_in_cell, refuse_nested_cell_magic, show_result,
                     silenced, sole_measuring_magic)
from .ran_before import ran_before, remember


@magics_class
class ProfileMagics(Magics):
    @output_can_be_silenced  # outermost: IPython reads the mark from the method it registered
    @magic_arguments(name="%profile_gpu")  # the usage line gets one more %: %%profile_gpu
    @help_option
    @argument("--top", type=int, default=15, help="rows of the operator table to show (default 15)")
    @argument("--sort", default=None, metavar="{" + ",".join(SORT_COLUMNS) + "}",  # read by sort_name, any case
              help="cpu (CPU total), self (self CPU), device (self device time), calls, memory (self bytes), flops; "
                   "default: device on CUDA, else self")
    @argument("--filter", default="", metavar="TEXT", help=FILTER_HELP)
    @argument("--memory", action="store_true", help="record memory allocated per op (profile_memory)")
    @argument("--shapes", action="store_true", help="group the table by op and input shapes")
    @argument("--stack", action="store_true", help="record Python stacks (with_stack); group by source line")
    @argument("--warmup", type=int, default=0, help="unrecorded runs of the cell before the active steps (default 0)")
    @argument("--steps", type=int, default=1, help="recorded runs of the cell (default 1)")
    @argument("--trace", default=None, metavar="PATH",
              help="write the Chrome/Perfetto trace: PATH.json (or .json.gz) is one file; any other name is a "
                   "folder with one {host}_{pid}.{ms}.pt.trace.json per step (tensorboard_trace_handler layout)")
    @argument("--amp", nargs="?", const="auto", default=None, metavar="DTYPE",
              help="profile under the %%%%amp recipe: autocast bf16|fp16|auto (+TF32 on CUDA); bare --amp = auto")
    @argument("--compare", default=None, metavar="NAME",
              help="also show this run op by op against an earlier profile stored with -r NAME: which ops got "
                   "slower or faster, which are new (e.g. -r p32 first, then --amp bf16 --compare p32); with -q "
                   "only the comparison is shown")
    @argument("--device", default="auto", help="auto, cpu or cuda[:N] (default: cuda when present)")
    @argument("-r", "--result", default=None, metavar="NAME", help="store the ProfileResult in this variable")
    @argument("-q", "--quiet", action="store_true", help="do not display the result (the profile)")
    @cell_magic
    @magic_spelled  # errors name options as typed: --top, not top=
    @comment_hinted  # '--top 5#rows' refused: says a comment needs a space before '#'
    def profile_gpu(self, line, cell):
        """Profile the cell with torch.profiler and show the slowest operators, time by category,
        Tensor Core use, achieved FLOP/s, matmul shapes to pad, and advice.

        Without a GPU the CPU is profiled, and the header says so. With --warmup W --steps S the
        cell runs W+S times, like W+S iterations of a training loop: its effects on your variables
        (model weights, counters, optimizer state) happen W+S times and are kept. Only the S
        active steps are analysed. Output of all but the last run is hidden; the cell's last
        expression value (of the last run) is the cell's result.

            %%profile_gpu --top 10 --warmup 2 --steps 3 --trace runs/step -r prof
            loss = train_step(model, batch)
        """
        __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
        args = parse_line(self.profile_gpu, line, hint=dtype_hint("--amp", DTYPES, dtype_name))
        if args is None:  # -h/--help: the help was printed
            return None
        check_name(args.result, counts="--steps")
        refuse_empty_cell(self.shell, "profile_gpu", cell)
        refuse_options_in_cell(self.profile_gpu, cell)
        refuse_nested_cell_magic("profile_gpu", cell)
        check_name_free(self.shell, args.result, cell)
        # ProfileOptions reads bfloat16, float16, half as the recipe names them; validate refuses the rest
        options = ProfileOptions(top=args.top, sort=args.sort, memory=args.memory, shapes=args.shapes,
                                 stack=args.stack, warmup=args.warmup, steps=args.steps, trace=args.trace,
                                 amp=args.amp, device=args.device, filter=args.filter)
        try:
            nested = _nested(PROFILE_MAGIC)  # run from inside a with nbaccel.profile() block
            if nested is not None:
                raise nested
            dev = validate(options)[0]  # every refusal happens here, before the cell runs
        except ProfileError as exc:
            raise UsageError(str(exc)) from None
        except KeyboardInterrupt as exc:  # reading the device can take a moment on a first call
            raise interrupted_in_nbaccel(exc, "%%profile_gpu", "while nbaccel checked the options",
                                         "the cell did not run") from None
        earlier = earlier_profile(self.shell, args.compare, dev)
        run = annotated_cell_function(self.shell, cell) if args.stack else cell_function(self.shell, cell)
        raised_in_cell = []  # what the cell itself raised: its own, shown as it is

        def cell_run():
            __tracebackhide__ = True  # noqa: F841 - IPython hides this frame
            try:
                return run()
            except BaseException as exc:  # noted, then re-raised unchanged
                raised_in_cell.append(exc)
                raise

        try:
            with sole_measuring_magic("profile_gpu"):
                result = profile_function(cell_run, options, silence=silenced)
        except ProfileError as exc:  # nbaccel's: a trace Kineto wrote as invalid JSON, a profiler started meanwhile
            if any(exc is e for e in raised_in_cell):  # the cell's own nbaccel.profile(...) call: the user's error
                raise
            raise UsageError(str(exc)) from None
        except KeyboardInterrupt as exc:  # the profile said where it landed (nbaccel.profile.__exit__)
            if any(exc is e for e in raised_in_cell):
                raise
            raise interrupt_without_frames(exc) from None  # in nbaccel's profiler: no nbaccel frames
        # a first run's setup is in its times: a comparison with it says so (profile_compare)
        result.first_run = not options.warmup and not ran_before(self.shell, cell, result.recipe_label)
        remember(cell, result.recipe_label)
        show_result(self.shell, "%%profile_gpu", result, args.result, args.quiet)
        if args.quiet and result.trace_created:
            # -q hides the report, not a folder made on the user's disk: a mistyped --trace path shows here
            print(f"nbaccel %%profile_gpu: wrote {', '.join(result.trace_files)}; created the folder {result.trace_created}")
        if earlier is not None:  # -q hides the profile; the comparison is what --compare asked to see (a trial)
            comparison = compare_profiles(earlier, result, labels=(args.compare, _this_run(result)),
                                          made_by=f"%%profile_gpu --compare {args.compare}")
            show_result(self.shell, "%%profile_gpu", comparison, None, False)
        return result.value


def _this_run(result) -> str:
    return f"this run, {result.recipe_label}" if result.recipe_label else "this run"


def earlier_profile(shell, name: str | None, dev):
    """The ProfileResult ``--compare NAME`` names, checked before the cell runs; None without the option."""
    if name is None:
        return None
    value = shell.user_ns.get(name, _MISSING)
    if value is _MISSING:
        raise UsageError(f"--compare {name}: there is no variable {name!r}. Store a profile first with "
                         f"%%profile_gpu -r {name} (e.g. without --amp), then profile again with --compare {name}")
    if not isinstance(value, ProfileResult):
        raise UsageError(f"--compare {name}: {name} is {a_type(value)}, not a profile; --compare takes a "
                         f"ProfileResult stored with %%profile_gpu -r {name} (or %profile_trace -r {name})")
    if value.device.type != dev.type:
        raise UsageError(f"--compare {name}: {name} was recorded on {value.device.type} and this profile runs on "
                         f"{dev.type}; their op times do not compare. Use --device {value.device.type}, or "
                         "compare with a profile of this device")
    return value


_MISSING = object()




def _line_marker(label: str, node: ast.AST) -> ast.withitem:
    # __import__('torch').profiler.record_function(label): builtins only, so nothing is added to
    # the user's namespace.
    torch_mod = ast.Call(func=ast.Name("__import__", ast.Load()), args=[ast.Constant("torch")], keywords=[])
    func = ast.Attribute(ast.Attribute(torch_mod, "profiler", ast.Load()), "record_function", ast.Load())
    item = ast.withitem(context_expr=ast.Call(func=func, args=[ast.Constant(label)], keywords=[]))
    return item


def annotated_cell_function(shell, cell: str):
    """Like `cell_function`, but each top-level statement runs inside a ``record_function``
    named after its cell line, so ``--stack`` can group ops by the line of the cell.

    Why: Kineto's Python tracer records where each *function* starts (``co_firstlineno``),
    not the executing line, so every op of a cell's top level would land on "line 0".
    A statement wrapped in ``with`` keeps its scope and line numbers (tracebacks unchanged);
    the cost is one ``record_function`` (about a microsecond) per executed top-level statement.
    """
    source, tree, filename = parse_cell(shell, cell)
    number = cell_number(shell)
    lines = source.splitlines()
    body, last = tree.body, None
    if body and isinstance(body[-1], ast.Expr):
        last = body[-1]
        body = body[:-1]

    def label(node) -> str:
        text = lines[node.lineno - 1].strip() if 0 < node.lineno <= len(lines) else ""
        # Kineto (torch 2.13) writes names into the JSON unescaped: a '"' breaks the trace, a
        # backslash becomes '/', and a name with a tab or non-ASCII becomes "unknown".
        text = re.sub(r"[^\x20-\x7e]", "?", text).replace('"', "'").replace("\\", "/")
        return cell_line_label(number, node.lineno, text)

    wrapped = []
    for stmt in body:
        if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
            wrapped.append(stmt)
            continue
        node = ast.With(items=[_line_marker(label(stmt), stmt)], body=[stmt])
        wrapped.append(ast.copy_location(node, stmt))
    module = ast.fix_missing_locations(ast.Module(body=wrapped, type_ignores=[]))
    code = compile_cell(shell, module, filename, "exec")
    expr = compile_cell(shell, ast.Expression(last.value), filename, "eval") if last is not None else None
    last_label = label(last) if last is not None else None
    ns = shell.user_ns

    def run_cell():
        import torch

        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame
        with magic_spelling(False):  # the cell's own API calls are Python (see cell_function)
            exec(code, shell.user_global_ns, ns)  # noqa: S102 - running the user's own cell is the point
            if expr is None:
                return None
            with torch.profiler.record_function(last_label):
                return eval(expr, shell.user_global_ns, ns)  # noqa: S307

    return run_cell
