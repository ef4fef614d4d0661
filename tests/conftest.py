import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # spawned ranks import test modules and helpers by name
