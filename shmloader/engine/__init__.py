"""The engine: the iterators the loader hands out and everything they run in the main process.

``plan`` (what an iterator is given, frozen), ``dispatch`` (which worker runs the next task),
``ledger`` (the one owner of every task's slot), ``reorder`` (which finished task is due),
``faults`` (what a death, hang or timeout becomes), ``workers`` (the processes and their pipes),
``iterator`` / ``mp_iterator`` (the single- and multi-process step loops), whose multi-process
steps are ``send`` (dispatch) and ``wait`` (replies, deaths, growth).
See docs/design/ownership.md.
"""
