"""Compiler and linker flags for the kvattn torch extension (make torch-ext),
from the torch that this python imports:

    python torch_flags.py cflags|libs WITH_CUDA CUDA_HOME

WITH_CUDA 1: the library was built with CUDA; the extension then takes CUDA
tensors too when this torch has CUDA (torch.version.cuda). Exits 1 with a
message when torch is not importable."""
import sys
import sysconfig

try:
    import torch
    import torch.utils.cpp_extension as ext
except Exception as e:  # noqa: BLE001 - any import failure means "no torch here"
    sys.exit("make torch-ext: torch is not importable by %s (%s); set PY=<a python with torch>" % (sys.executable, e))

what, with_cuda, cuda_home = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
cuda = with_cuda and bool(torch.version.cuda)
if what == "cflags":
    flags = ["-isystem" + p for p in ext.include_paths()]  # system headers: their warnings are not ours
    flags.append("-D_GLIBCXX_USE_CXX11_ABI=%d" % int(torch._C._GLIBCXX_USE_CXX11_ABI))
    # the eager Python entry points (PyInit_libkvattn_torch) next to the operators
    flags += ["-DKVATTN_TORCH_PYTHON=1", "-isystem" + sysconfig.get_paths()["include"]]
    if cuda:
        flags += ["-DKVATTN_TORCH_CUDA=1", "-isystem" + cuda_home + "/include"]
    print(" ".join(flags))
elif what == "libs":
    flags = ["-L" + p for p in ext.library_paths()] + ["-ltorch", "-ltorch_cpu", "-lc10", "-ltorch_python"]
    if cuda:
        flags += ["-ltorch_cuda", "-lc10_cuda", "-L" + cuda_home + "/lib64", "-lcudart"]
    print(" ".join(flags))
else:
    sys.exit("torch_flags.py: unknown request %r (cflags or libs)" % what)
