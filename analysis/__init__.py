"""Analysis: campaign results into pandas, metric definitions, reports and plots."""
