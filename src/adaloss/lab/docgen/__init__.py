"""Rendering the documentation's tables and figures from the committed result files
(``scripts/render_docs.py``).

The pages (``README.md``, ``docs/**/*.md``) hold *generated regions*::

    <!-- generated: NAME -->
    ...
    <!-- end generated: NAME -->

and :func:`~adaloss.lab.docgen.pages.write` fills each one from the files named in
:data:`~adaloss.lab.docgen.regions.REGIONS`, and copies the mini reproduction's figures into
``docs/assets/mini/``. ``tests/test_docs_render.py`` checks the committed pages against what it renders, so a
page cannot drift from its results.

    python scripts/render_docs.py            # rewrite the regions and the figures
    python scripts/render_docs.py --check    # exit 1 and list what differs, writing nothing
    python scripts/render_docs.py stamp results/bench/bench.json --command "make bench"

``stamp`` records in a measurement-of-record JSON (``scripts/bench.py``'s output) what the bench itself does
not: the commit it measured (default: ``HEAD``; ``dirty`` when tracked files differ from it) and the command
that produced it. The performance page shows both beside the machine, torch version and date the JSON holds.

The modules: :mod:`~adaloss.lab.docgen.markdown` (rewriting Markdown), :mod:`~adaloss.lab.docgen.regions` (a
renderer per region), :mod:`~adaloss.lab.docgen.pages` (pages, render, differences, write),
:mod:`~adaloss.lab.docgen.stamp` and :mod:`~adaloss.lab.docgen.cli` (the command line).
"""
