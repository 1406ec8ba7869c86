"""Moving a recipe to a new commit of a source it builds on (`toolkit upgrade`): each transform that reads or writes
the source's files tried on the new commit's files and given a fate beside the old pin's (`fates`), and the layers
rewritten with the new pin, the moved anchors and the removals, comments and layout kept (`write`).

It may import the recipe, the transform kinds, the sources (the files at a commit) and the engine's one per-file
evaluation; the clone, the commits and what is shown are the caller's (toolkit.commands.upgrade).
"""
