"""ctest's entry for one Python test file: exits 77 (ctest: skipped) with the reason when this
interpreter lacks torch or the built module (or the file needs CUDA and torch sees no device),
else runs pytest on the file (or, with `--script FILE`, runs FILE as a program)."""

import sys

try:
    import torch  # noqa: F401
except ImportError as e:
    print(f"SKIP: python3-torch is not installed for {sys.executable}: {e}")
    sys.exit(77)
try:
    import wsync  # noqa: F401
except ImportError as e:
    print(f"SKIP: the wsync module does not import with {sys.executable}: {e}")
    sys.exit(77)

# A test file that says "wsync-test-requires: cuda" needs a CUDA device torch can use.
if sys.argv[1:2] != ["--script"] and sys.argv[1:]:
    with open(sys.argv[1], encoding="utf-8") as f:
        needs_cuda = "wsync-test-requires: cuda" in f.read()
    if needs_cuda and not torch.cuda.is_available():
        print(f"SKIP: {sys.argv[1]} needs a CUDA device, and torch {torch.__version__} sees none")
        sys.exit(77)

if sys.argv[1:2] == ["--script"]:
    import runpy  # noqa: E402

    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
    sys.exit(0)

import pytest  # noqa: E402

sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
