"""``make results-check``: rerun a sample of every committed result shown on a page and compare.

Every result family the documentation shows (a lab's table, the mini reproduction's tables and claims, the
demo's table on the home page) has samples here (:mod:`.samples`): its cheapest committed cells, each rerun at
exactly its committed settings through the code the lab itself runs (:mod:`.reruns`), in a child process of
its own, and compared with the committed numbers (:mod:`.compare`):

* bit for bit when the kernel path the result was recorded on (``record.json`` beside it,
  :func:`adaloss.runner.provenance.result_record`) is this process's
  (:func:`adaloss.runner.provenance.kernel_key`: torch's CPU capability, oneDNN's and MKL's instruction sets,
  threads);
* otherwise within the sample's stated tolerance on its headline number, the spread of every number reported.

A mismatch names the result, the cell and the command that regenerates it. The records of hardware we do not
have (``results/gpu``) and of timings (``results/bench``) are listed with their commit and whether the code
changed since, not rerun. ``quick`` samples (CI, ``make results-check``) take seconds each; ``--full`` adds
the mini reproduction's and the claims' cells and the demo's FP32 row (minutes; ``make test-full``).
"""
