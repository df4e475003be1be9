"""`anatomy train`: data (text, token .bin, saved HF dataset, or the embedded corpus), a locally trained
BPE tokenizer, the training loop (one process, DDP or FSDP2), verified checkpoints and the run's log.

    data.load_data(paths, vocab) -> TokenData       tokenizer.load_or_train(docs, vocab) -> CachedTokenizer
    loop.train(cfg, run, variant, data, TrainOptions) -> summary dict (raises ConfigError, Diverged)
      options   TrainOptions, lr_at                 setup     placement, model, optimizer
      resume    the newest intact checkpoint        lock      one run per directory
      identity  what a resume must keep, or be allowed to change
    checkpoint.save / load: safetensors shards      manifest  sha256 of every file, check(), find()
    shard_header: a shard's header checked before safetensors reads it
    storage: a failed write (a full disk) as one line naming the path and the errno
    report.write(out, summary): train_log.json, loss.png
    progress: the bar/lines, MFU's peak table       cli.main(argv) -> exit code (0, 2, 3, 130)
"""
