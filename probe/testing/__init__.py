"""What the tests and the benchmark scripts share: configs composed as the CLI composes them
(`compose`), a run file's arrays by name (`arrays`), values computed without the pipeline that the
pipeline's files are compared with (`oracles`), and small models and tokenizers built locally
(`models`, `tokens`). Nothing in the pipeline imports it.
"""
