from reinforce.trainer.main import main

main()
