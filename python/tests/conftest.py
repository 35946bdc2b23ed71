"""pytest setup: the tests import `kvref` (their numpy references) from this folder."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
