"""The argument parser every localchat command uses: a usage error is one line on stderr
that names the flag and points at --help (argparse's default prints the whole usage
block first), with exit code 2."""
from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)
