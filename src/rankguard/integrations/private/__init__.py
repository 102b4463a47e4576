"""Every private name of a framework rankguard reads, one module per framework.

A framework's public API does not say everything an adapter needs (which
Trainer is calling a hook, the path a Trainer is about to load, the names a
loop logged for reduction). Each such read is a named function here, in its
framework's module, with a docstring saying what it reads and why no public
API serves, and a test in ``tests/integrations/test_private_<framework>.py``
that fails when the installed framework changes it. Nothing else in
``rankguard.integrations`` reads a framework's private names
(``tests/integrations/test_private_reaches.py`` checks).
"""
