"""Children of this package (gguf_mcv/children.py): the command, its environment, how it ended in words."""

import signal
import subprocess
import sys

from gguf_mcv.children import child_command, child_env, describe_exit


def test_signal_names_in_the_words_of_an_exit() -> None:
    assert describe_exit(-signal.SIGILL, ["", "Illegal instruction"]) == "killed by SIGILL (Illegal instruction)"
    assert describe_exit(3) == "exited with status 3"


def test_a_child_runs_this_copy_of_the_package() -> None:
    import gguf_mcv

    python, flag = child_command("gguf_mcv.units")[:2]
    assert (python, flag) == (sys.executable, "-c")
    done = subprocess.run([python, flag, "import gguf_mcv; print(gguf_mcv.__file__)"], capture_output=True,
                          text=True, env=child_env(), timeout=60, check=True, cwd="/")
    assert done.stdout.strip() == gguf_mcv.__file__
