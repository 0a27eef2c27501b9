"""`python -m mpidist.torch.backend [-v]`: build the C++ extension now (the test set-up
does, so the first process group does not wait for the compiler) and print its path."""
import sys

from mpidist.torch.backend import build

build.load(verbose="-v" in sys.argv[1:])
print(build.library())
