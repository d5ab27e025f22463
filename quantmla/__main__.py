from quantmla.run import cli

cli()
