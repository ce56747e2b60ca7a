"""The configs shipped with longvideo (YAML and JSON files beside this one), installed as the
package `longvideo.configs` so that `--config tiny` works after `pip install longvideo` as well as
in a checkout. See docs/configs.md."""
