"""The training loop's side of checkpoints: where and how a save lands, not what
tensors it holds (that is the plan's checkpoint I/O one folder up: `source`,
`inspect`, `load`, `save`, ...).

- `atomic` and `commit`: crash-safe saves (staging beside the target, fsync, the
  swap into place, the lock; rank 0 commits, every rank hears the verdict);
- `complete`: the manifest every save writes, and whether a directory is a
  complete checkpoint (TP609);
- `steps`: a training root of `step-N` directories, its `latest` marker, retention
  (`keep=`), and which step a resume loads;
- `state`: what a training checkpoint holds beside the model (the optimizer's
  state, `extra`), saved and restored;
- `asyncsave`: `async_save=True`, the write in the background.

None of these knows a model or a plan: they import nothing of the checkpoint
package but its errors (tests/test_layout.py checks), so `save_checkpoint` and
`load_checkpoint` compose them with the tensors, never the reverse.
"""
