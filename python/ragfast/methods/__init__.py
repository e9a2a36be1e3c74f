"""The four multi-round methods, one package each: its loop, its evaluation and its report section.

A method builds on components (``retrieval``, ``models``) and records (``types``, ``cost``); it
never imports the runner or the commands.
"""
