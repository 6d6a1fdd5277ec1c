"""``%nbaccel_env``: versions, device capabilities and current precision flags."""

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..environment import env_report
from ..render.display import display_result
from .common import check_name, help_option, parse_line, store_result


@magics_class
class EnvMagics(Magics):
    @magic_arguments()
    @help_option
    @argument("-r", "--result", default=None, metavar="NAME", help="store the EnvReport in this variable")
    @argument("--json", action="store_true", help="print the report as JSON (as python -m nbaccel env --json)")
    @line_magic
    def nbaccel_env(self, line):
        """Show torch/CUDA/cuDNN versions, the device, bf16/fp16/TF32/Tensor Core/AMX support
        and the global precision flags as they are now."""
        args = parse_line(self.nbaccel_env, line)
        if args is None:  # -h/--help: the help was printed
            return None
        check_name(args.result)
        report = env_report()
        store_result(self.shell, args.result, report)
        if args.json:  # to paste into a bug report
            print(report.to_json(indent=2))
        else:
            display_result(report)
