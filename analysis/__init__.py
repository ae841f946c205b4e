"""Campaign analysis: ``analysis.load(campaign_dir)`` gives the DataFrames, :mod:`analysis.metrics`
defines the papers' metrics, :mod:`analysis.report` writes ``testbed report``'s files."""

from analysis.load import CampaignData, load

__all__ = ["CampaignData", "load"]
