"""``%nbaccel_env``: versions, device capabilities and current precision flags."""

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..environment import env_report
from ..render.display import display_result
from .common import check_name, comment_hinted, help_option, parse_line, store_result


@magics_class
class EnvMagics(Magics):
    @magic_arguments()
    @help_option
    @argument("-r", "--result", default=None, metavar="NAME", help="store the EnvReport in this variable")
    @argument("--json", action="store_true", help="print the report as JSON (as python -m nbaccel env --json)")
    # as in every other magic (it was "unrecognized arguments: -q"): show nothing, only store with -r
    @argument("-q", "--quiet", action="store_true", help="do not display the report")
    @line_magic
    @comment_hinted  # '-r env#1' refused: says a comment needs a space before '#'
    def nbaccel_env(self, line):
        """Show torch/CUDA/cuDNN versions, the device, bf16/fp16/TF32/Tensor Core/AMX support
        and the global precision flags as they are now."""
        args = parse_line(self.nbaccel_env, line)
        if args is None:  # -h/--help: the help was printed
            return None
        check_name(args.result)
        if args.quiet and args.json:  # one asks for output, the other for none
            raise UsageError("--json prints the report and -q/--quiet shows nothing: give one (-q -r NAME keeps "
                             "the report, NAME.to_json() gives its JSON)")
        if args.quiet and not args.result:  # it printed nothing and kept nothing: a silent no-op (a trial)
            raise UsageError("-q/--quiet shows nothing and, without -r NAME, keeps nothing: add -r NAME to store "
                             "the report (%nbaccel_env -q -r env), or leave -q out to see it")
        report = env_report()
        store_result(self.shell, args.result, report)
        if args.quiet:
            return
        if args.json:  # to paste into a bug report
            print(report.to_json(indent=2))
        else:
            display_result(report)
