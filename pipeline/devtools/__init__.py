"""Developer tools, apart from the pipeline's core (docs/architecture.md, "Layout").

What a worker in production never imports: the benchmarks (:mod:`pipeline.devtools.bench`), the demo,
the dedup evaluation, the embedded Kafka broker, the process runner, the deployment builder the demo,
the benchmarks and the tests share, and the sample questions.
"""
