"""``%profile_trace PATH``: a torch.profiler trace recorded elsewhere, shown like ``%%profile_gpu``."""

from __future__ import annotations


from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..options import magic_spelled
from ..profile_options import FILTER_HELP, ProfileError
from ..profile_table import SORT_COLUMNS
from ..render.common import note_on_stderr
from ..render.display import display_result
from ..trace_result import TraceError, load_trace, trace_warnings_said
from .common import check_name, comment_hinted, help_option, parse_line, store_result


@magics_class
class TraceMagics(Magics):
    @magic_arguments()
    @help_option
    @argument("path", metavar="PATH",
              help="a .json / .json.gz trace file, or a folder of them (one rank per distributedInfo.rank or "
                   "'rank-N' in the name; several files of one rank are its steps)")
    @argument("--top", type=int, default=15, help="rows of the operator table to show (default 15)")
    @argument("--sort", default=None, metavar="{" + ",".join(SORT_COLUMNS) + "}",  # read by sort_name, any case
              help="cpu (CPU total), self (self CPU), device (self device time), calls, memory, flops; "
                   "default: device when the trace has kernels, else self")
    @argument("--filter", default="", metavar="TEXT", help=FILTER_HELP)
    @argument("--shapes", action="store_true", help="group the table by op and input shapes")
    @argument("--stack", action="store_true",
              help="group by recorded Python source (traces made with with_stack=True)")
    @argument("--memory", action="store_true",
              help="charge recorded [memory] events to ops (traces made with profile_memory=True)")
    @argument("--rank", type=int, default=None, help="in a folder of several ranks, load only this rank")
    @argument("-r", "--result", default=None, metavar="NAME",
              help="store the result (ProfileResult, or MultiRankResult for several ranks) in this variable")
    @argument("-q", "--quiet", action="store_true", help="do not display the result")
    @line_magic
    @magic_spelled  # errors name options as typed: --top, not top=
    @comment_hinted  # '--top 5#rows' refused: says a comment needs a space before '#'
    def profile_trace(self, line):
        """Analyse a torch.profiler Chrome trace recorded elsewhere (a cluster job, a colleague's run):
        the same operator table, kernels, categories, device busy/idle, Tensor Core share and FLOP/s
        as %%profile_gpu, against the peak of the GPU the trace names. A folder of per-rank traces
        shows each rank's step time, its compute / communication / idle split and the slowest rank.

            %profile_trace runs/rank0.pt.trace.json.gz --top 20 -r tr
            %profile_trace runs/job42/            # one file per rank
        """
        args = parse_line(self.profile_trace, line)
        if args is None:  # -h/--help: the help was printed
            return None
        check_name(args.result)  # --top is checked by load_trace (a ProfileError, turned into a UsageError below)
        try:
            with trace_warnings_said(lambda message: note_on_stderr(f"Warning: {message}")):
                result = load_trace(args.path, rank=args.rank, top=args.top, sort=args.sort, shapes=args.shapes,
                                    stack=args.stack, memory=args.memory, filter=args.filter)
        except (TraceError, ProfileError) as exc:
            raise UsageError(str(exc)) from None
        store_result(self.shell, args.result, result)
        if not args.quiet:
            display_result(result)
        return None
