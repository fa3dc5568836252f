"""Print the ROT13 of the arguments (joined by spaces), or of standard input."""

import codecs
import sys

text = " ".join(sys.argv[1:]) if len(sys.argv) > 1 else sys.stdin.read()
print(codecs.encode(text, "rot13"))
